# Private routing between a region's VPC and the database region's VPC (inter-region peering):
# GTM nodes everywhere reach the one PostgreSQL without it ever facing the internet.

resource "aws_vpc_peering_connection" "this" {
  vpc_id      = var.requester.vpc_id
  peer_vpc_id = var.accepter.vpc_id
  peer_region = var.accepter.region
  auto_accept = false
  tags        = merge(var.tags, { Name = var.name })

  lifecycle {
    precondition {
      condition     = var.requester.cidr != var.accepter.cidr
      error_message = "Peered VPCs need ranges that do not overlap."
    }
  }
}

resource "aws_vpc_peering_connection_accepter" "this" {
  provider                  = aws.accepter
  vpc_peering_connection_id = aws_vpc_peering_connection.this.id
  auto_accept               = true
  tags                      = merge(var.tags, { Name = var.name })
}

resource "aws_route" "to_accepter" {
  count                     = length(var.requester.route_table_ids)
  route_table_id            = var.requester.route_table_ids[count.index]
  destination_cidr_block    = var.accepter.cidr
  vpc_peering_connection_id = aws_vpc_peering_connection.this.id
}

resource "aws_route" "to_requester" {
  provider                  = aws.accepter
  count                     = length(var.accepter.route_table_ids)
  route_table_id            = var.accepter.route_table_ids[count.index]
  destination_cidr_block    = var.requester.cidr
  vpc_peering_connection_id = aws_vpc_peering_connection_accepter.this.id
}
