output "kms_key_arn" {
  description = "ARN of the region's KMS key (customer managed, rotated yearly): EBS volumes, logs, secrets' replicas and the database use it."
  value       = aws_kms_key.region.arn
}

output "vpc_id" {
  description = "ID of the region's VPC."
  value       = aws_vpc.this.id
}

output "vpc_cidr" {
  description = "The VPC's IPv4 range."
  value       = aws_vpc.this.cidr_block
}

output "public_subnet_ids" {
  description = "Public subnets, one per availability zone (load balancers, NAT gateways)."
  value       = aws_subnet.public[*].id
}

output "private_subnet_ids" {
  description = "Private subnets, one per availability zone (instances, the database)."
  value       = aws_subnet.private[*].id
}

output "private_route_table_ids" {
  description = "Route tables of the private subnets (peering routes go here)."
  value       = aws_route_table.private[*].id
}

output "nat_public_ips" {
  description = "Addresses the region's instances reach the internet from: capacity reports pushed to GTM come from these (GTM_OPS_ALLOW)."
  value       = aws_eip.nat[*].public_ip
}
