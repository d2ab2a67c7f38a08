# One region's GTM nodes: fixed, named instances (each a stable vote in the health membership),
# behind an internet-facing network load balancer with one Elastic IP per availability zone
# (the addresses the parent zone's glue names): UDP+TCP 53 to the DNS listener, TCP 80 (and
# TLS 443 when a certificate is given) to the HTTP front. Client addresses are preserved, so
# GeoDNS and the front see the real client.

data "aws_region" "current" {}
data "aws_partition" "current" {}

data "aws_ssm_parameter" "al2023" {
  count = var.ami_id == null ? 1 : 0
  name  = "/aws/service/ami-amazon-linux-latest/al2023-ami-kernel-default-x86_64"
}

locals {
  region    = data.aws_region.current.name
  partition = data.aws_partition.current.partition
  ami       = var.ami_id != null ? var.ami_id : nonsensitive(data.aws_ssm_parameter.al2023[0].value)
  names     = sort(keys(var.nodes))
  bootstrap = var.bootstrap == null ? null : local.names[0]

  # A secret's replica in this region has the primary's ARN with this region in it.
  here = { for k, arn in merge(var.fleet_secrets.arns, var.login_secrets.arns) : k => format(
    "%s:%s:%s",
    join(":", slice(split(":", arn), 0, 3)),
    local.region,
    join(":", slice(split(":", arn), 4, length(split(":", arn)))),
  ) }

  geoip_object_arn = var.geoip_s3_uri == null ? null : "arn:${local.partition}:s3:::${trimprefix(var.geoip_s3_uri, "s3://")}"
}

# -- network ---------------------------------------------------------------------------------

resource "aws_eip" "lb" {
  #checkov:skip=CKV2_AWS_19:These addresses belong to the network load balancer (subnet_mapping), not to instances: they are the name servers' glue.
  count  = length(var.public_subnet_ids)
  domain = "vpc"
  tags   = merge(var.tags, { Name = "${var.name}-dns-${count.index}" })
}

resource "aws_lb" "this" {
  #checkov:skip=CKV2_AWS_20:A network load balancer with DNS on 53: port 80 is the HTTP front itself, whose answers are redirects (a 301 to https would be a second round trip for every client).
  #checkov:skip=CKV_AWS_91:NLB access logs cover TLS listeners only; DNS and HTTP answers are audited by GTM itself (every answer is a row of the audit store).
  name                             = "${var.name}-nlb"
  load_balancer_type               = "network"
  internal                         = false
  enable_cross_zone_load_balancing = true
  enable_deletion_protection       = var.deletion_protection
  tags                             = var.tags

  dynamic "subnet_mapping" {
    for_each = var.public_subnet_ids
    content {
      subnet_id     = subnet_mapping.value
      allocation_id = aws_eip.lb[subnet_mapping.key].id
    }
  }
}

resource "aws_lb_target_group" "dns" {
  name                 = "${var.name}-dns"
  port                 = 5353
  protocol             = "TCP_UDP"
  vpc_id               = var.vpc_id
  target_type          = "instance"
  preserve_client_ip   = true
  deregistration_delay = 30
  tags                 = var.tags

  # A node is in service when its front says ready (it answers DNS from the same snapshot).
  health_check {
    protocol            = "HTTP"
    port                = "8080"
    path                = "/readyz"
    interval            = 10
    healthy_threshold   = 2
    unhealthy_threshold = 2
  }
}

resource "aws_lb_target_group" "http" {
  name                 = "${var.name}-http"
  port                 = 8080
  protocol             = "TCP"
  vpc_id               = var.vpc_id
  target_type          = "instance"
  preserve_client_ip   = true
  deregistration_delay = 30
  tags                 = var.tags

  health_check {
    protocol            = "HTTP"
    port                = "traffic-port"
    path                = "/readyz"
    interval            = 10
    healthy_threshold   = 2
    unhealthy_threshold = 2
  }
}

resource "aws_lb_listener" "dns" {
  load_balancer_arn = aws_lb.this.arn
  port              = 53
  protocol          = "TCP_UDP"
  tags              = var.tags
  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.dns.arn
  }
}

resource "aws_lb_listener" "http" {
  load_balancer_arn = aws_lb.this.arn
  port              = 80
  protocol          = "TCP"
  tags              = var.tags
  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.http.arn
  }
}

resource "aws_lb_listener" "https" {
  count             = var.certificate_arn == null ? 0 : 1
  load_balancer_arn = aws_lb.this.arn
  port              = 443
  protocol          = "TLS"
  certificate_arn   = var.certificate_arn
  ssl_policy        = "ELBSecurityPolicy-TLS13-1-2-2021-06"
  tags              = var.tags
  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.http.arn
  }
}

resource "aws_security_group" "node" {
  name_prefix = "${var.name}-node-"
  description = "GTM nodes: DNS and HTTP from anywhere (client addresses preserved), admin and metrics from private ranges"
  vpc_id      = var.vpc_id
  tags        = var.tags

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "dns_udp" {
  security_group_id = aws_security_group.node.id
  description       = "DNS over UDP from any resolver (through the NLB, client address kept)"
  ip_protocol       = "udp"
  from_port         = 5353
  to_port           = 5353
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_ingress_rule" "dns_tcp" {
  security_group_id = aws_security_group.node.id
  description       = "DNS over TCP from any resolver (through the NLB, client address kept)"
  ip_protocol       = "tcp"
  from_port         = 5353
  to_port           = 5353
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_ingress_rule" "http" {
  #checkov:skip=CKV_AWS_260:The HTTP front answers the public (redirects to the chosen region); the NLB keeps client addresses, so the rule must admit any source.
  security_group_id = aws_security_group.node.id
  description       = "HTTP front from any client (through the NLB, client address kept)"
  ip_protocol       = "tcp"
  from_port         = 8080
  to_port           = 8080
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_ingress_rule" "admin" {
  for_each          = var.admin.enabled ? toset(var.admin.allowed_cidrs) : toset([])
  security_group_id = aws_security_group.node.id
  description       = "Admin API from operators' private ranges"
  ip_protocol       = "tcp"
  from_port         = 9000
  to_port           = 9000
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_ingress_rule" "metrics" {
  for_each          = toset(var.monitoring_cidrs)
  security_group_id = aws_security_group.node.id
  description       = "Prometheus scrapes"
  ip_protocol       = "tcp"
  from_port         = 9100
  to_port           = 9100
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "https" {
  security_group_id = aws_security_group.node.id
  description       = "Probes of the regional balancers, AWS APIs, package index"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_egress_rule" "packages" {
  security_group_id = aws_security_group.node.id
  description       = "Operating system package mirrors"
  ip_protocol       = "tcp"
  from_port         = 80
  to_port           = 80
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_egress_rule" "database" {
  security_group_id = aws_security_group.node.id
  description       = "The shared PostgreSQL (TLS)"
  ip_protocol       = "tcp"
  from_port         = var.database.port
  to_port           = var.database.port
  cidr_ipv4         = var.database.cidr
}

# -- identity: one role per node, each reading only its own login --------------------------

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "node" {
  for_each = var.nodes

  statement {
    sid     = "ReadOwnSecrets"
    actions = ["secretsmanager:GetSecretValue"]
    resources = concat(
      [
        local.here["report-secret"], local.here["document-public-key"],
        local.here["dns-cookie-secret"], local.here[each.value.login],
      ],
      var.admin.enabled ? [local.here["document-signing-key"]] : [],
    )
  }
  statement {
    sid       = "DecryptWithTheRegionKey"
    actions   = ["kms:Decrypt"]
    resources = [var.kms_key_arn]
  }
  statement {
    sid       = "SyncCheckpoints"
    actions   = ["s3:PutObject", "s3:GetObject", "s3:ListBucket"]
    resources = [var.checkpoint_bucket.arn, "${var.checkpoint_bucket.arn}/*"]
  }
  statement {
    sid       = "EncryptCheckpoints"
    actions   = ["kms:GenerateDataKey", "kms:Decrypt"]
    resources = [var.checkpoint_bucket.kms_key_arn]
  }
  dynamic "statement" {
    for_each = local.geoip_object_arn == null ? [] : [local.geoip_object_arn]
    content {
      sid       = "FetchGeoIP"
      actions   = ["s3:GetObject"]
      resources = [statement.value]
    }
  }
  dynamic "statement" {
    for_each = each.key == local.bootstrap ? [var.bootstrap] : []
    content {
      sid     = "BootstrapWritesSecrets"
      actions = ["secretsmanager:PutSecretValue", "secretsmanager:GetSecretValue"]
      resources = concat(
        values(var.fleet_secrets.arns),
        [for login, _ in statement.value.logins : var.login_secrets.arns[login]],
      )
    }
  }
  dynamic "statement" {
    for_each = each.key == local.bootstrap ? [var.bootstrap] : []
    content {
      sid       = "BootstrapReadsTheOwner"
      actions   = ["secretsmanager:GetSecretValue"]
      resources = [statement.value.master_secret_arn]
    }
  }
  dynamic "statement" {
    for_each = each.key == local.bootstrap ? [var.bootstrap] : []
    content {
      sid       = "BootstrapEncrypts"
      actions   = ["kms:GenerateDataKey", "kms:Encrypt"]
      resources = [var.kms_key_arn]
    }
  }
}

resource "aws_iam_role" "node" {
  for_each           = var.nodes
  name_prefix        = "${substr(each.key, 0, 30)}-"
  assume_role_policy = data.aws_iam_policy_document.assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy" "node" {
  for_each = var.nodes
  name     = "gtm-node"
  role     = aws_iam_role.node[each.key].id
  policy   = data.aws_iam_policy_document.node[each.key].json
}

resource "aws_iam_role_policy_attachment" "ssm" {
  for_each   = var.nodes
  role       = aws_iam_role.node[each.key].name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "node" {
  for_each    = var.nodes
  name_prefix = "${substr(each.key, 0, 30)}-"
  role        = aws_iam_role.node[each.key].name
  tags        = var.tags
}

# -- the nodes --------------------------------------------------------------------------------

module "config" {
  source   = "../gtm-node-config"
  for_each = var.nodes

  node_name      = each.key
  aws_region     = local.region
  admin          = var.admin.enabled
  health_members = var.health_members
  ops_allow      = var.ops_allow
  settings       = var.settings
  topology_yaml  = var.topology_yaml
  policies       = var.policies
  geoip_s3_uri   = var.geoip_s3_uri
  package        = var.package
  database       = { host = var.database.host, port = var.database.port, name = var.database.name }
  checkpoint_bucket = {
    name   = var.checkpoint_bucket.name
    region = var.checkpoint_bucket.region
  }
  secrets = {
    report_secret         = var.fleet_secrets.names["report-secret"]
    document_signing_key  = var.fleet_secrets.names["document-signing-key"]
    document_public_key   = var.fleet_secrets.names["document-public-key"]
    admin_bootstrap_token = var.fleet_secrets.names["admin-bootstrap-token"]
    dns_cookie_secret     = var.fleet_secrets.names["dns-cookie-secret"]
    db_login              = var.login_secrets.names[each.value.login]
  }
  bootstrap = each.key != local.bootstrap ? null : {
    master_secret = var.bootstrap.master_secret_arn
    logins        = { for login, l in var.bootstrap.logins : login => { role = l.role, secret = var.login_secrets.names[login] } }
    report_keys   = { for r in var.bootstrap.report_key_regions : r => var.fleet_secrets.names["report-key/${r}"] }
  }
}

resource "aws_instance" "node" {
  for_each = var.nodes

  ami                     = local.ami
  instance_type           = var.instance_type
  subnet_id               = var.private_subnet_ids[index(local.names, each.key) % length(var.private_subnet_ids)]
  vpc_security_group_ids  = [aws_security_group.node.id]
  iam_instance_profile    = aws_iam_instance_profile.node[each.key].name
  user_data_base64        = module.config[each.key].user_data_base64
  monitoring              = true
  ebs_optimized           = true
  disable_api_termination = var.deletion_protection
  tags                    = merge(var.tags, { Name = each.key, "gtm:role" = "gtm-node", "gtm:node" = each.key })

  metadata_options {
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    http_endpoint               = "enabled"
  }

  # The audit spool, the chain keys and the checkpoint sink live here until they are flushed
  # and synced: stop gtm (it flushes) before replacing a node.
  root_block_device {
    volume_type           = "gp3"
    volume_size           = 30
    encrypted             = true
    kms_key_id            = var.kms_key_arn
    delete_on_termination = true
  }

  maintenance_options {
    auto_recovery = "default"
  }

  lifecycle {
    ignore_changes = [ami, user_data_base64]
  }
}

resource "aws_lb_target_group_attachment" "dns" {
  for_each         = var.nodes
  target_group_arn = aws_lb_target_group.dns.arn
  target_id        = aws_instance.node[each.key].id
}

resource "aws_lb_target_group_attachment" "http" {
  for_each         = var.nodes
  target_group_arn = aws_lb_target_group.http.arn
  target_id        = aws_instance.node[each.key].id
}
