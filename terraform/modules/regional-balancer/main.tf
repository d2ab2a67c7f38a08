# One region's balancer: regional-lb replicas in an autoscaling group behind an internal
# application load balancer (TLS, long idle timeout for streams, /admin and /metrics refused),
# reached through a network load balancer with one Elastic IP per availability zone: those
# addresses are what GTM answers with for the region (A records need fixed addresses).

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
  report_key_here = format(
    "%s:%s:%s",
    join(":", slice(split(":", var.report_key_secret.arn), 0, 3)),
    local.region,
    join(":", slice(split(":", var.report_key_secret.arn), 4, length(split(":", var.report_key_secret.arn)))),
  )
}

module "config" {
  source            = "../balancer-node-config"
  region_id         = var.region_id
  aws_region        = local.region
  config_yaml       = var.config_yaml
  gtm_urls          = var.gtm_urls
  report_key_secret = var.report_key_secret.name
  package           = var.package
}

# -- the public side: fixed addresses ---------------------------------------------------------

resource "aws_eip" "lb" {
  #checkov:skip=CKV2_AWS_19:These addresses belong to the network load balancer (subnet_mapping): they are the region's answer addresses in the topology.
  count  = length(var.public_subnet_ids)
  domain = "vpc"
  tags   = merge(var.tags, { Name = "${var.name}-${count.index}" })
}

resource "aws_lb" "public" {
  #checkov:skip=CKV_AWS_91:This NLB passes TCP through to the application load balancer, whose access logs are the ones that see requests.
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

resource "aws_lb_target_group" "alb" {
  name        = "${var.name}-alb"
  target_type = "alb"
  port        = 443
  protocol    = "TCP"
  vpc_id      = var.vpc_id
  tags        = var.tags

  health_check {
    protocol = "HTTPS"
    path     = "/readyz"
  }
}

resource "aws_lb_target_group_attachment" "alb" {
  target_group_arn = aws_lb_target_group.alb.arn
  target_id        = aws_lb.internal.arn
  port             = 443
  depends_on       = [aws_lb_listener.https]
}

resource "aws_lb_listener" "public" {
  load_balancer_arn = aws_lb.public.arn
  port              = 443
  protocol          = "TCP"
  tags              = var.tags
  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.alb.arn
  }
}

resource "aws_route53_record" "hostname" {
  count   = var.route53_zone_id == null ? 0 : 1
  zone_id = var.route53_zone_id
  name    = var.hostname
  type    = "A"
  ttl     = 300
  records = aws_eip.lb[*].public_ip
}

# -- the internal application load balancer -----------------------------------------------------

resource "aws_security_group" "alb" {
  name_prefix = "${var.name}-alb-"
  description = "Internal ALB of the regional balancer: HTTPS from the NLB (client addresses kept)"
  vpc_id      = var.vpc_id
  tags        = var.tags

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "alb_https" {
  security_group_id = aws_security_group.alb.id
  description       = "HTTPS from inference clients, through the network load balancer"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_egress_rule" "alb_to_replicas" {
  security_group_id            = aws_security_group.alb.id
  description                  = "To the balancer replicas"
  ip_protocol                  = "tcp"
  from_port                    = 8600
  to_port                      = 8600
  referenced_security_group_id = aws_security_group.replica.id
}

resource "aws_lb" "internal" {
  #checkov:skip=CKV_AWS_91:Access logs need a log bucket per region, which this module leaves to the account's logging set-up; the balancer's own metrics count every request by outcome.
  #checkov:skip=CKV2_AWS_28:The ALB is internal; the public entry is the network load balancer, where a WAF cannot attach. Tenants are rate-limited by the balancer itself.
  name                       = "${var.name}-alb"
  load_balancer_type         = "application"
  internal                   = true
  subnets                    = var.private_subnet_ids
  security_groups            = [aws_security_group.alb.id]
  idle_timeout               = var.stream_idle_timeout_s
  drop_invalid_header_fields = true
  desync_mitigation_mode     = "strictest"
  enable_deletion_protection = var.deletion_protection
  tags                       = var.tags
}

resource "aws_lb_target_group" "replicas" {
  name                 = "${var.name}-rlb"
  port                 = 8600
  protocol             = "HTTP"
  vpc_id               = var.vpc_id
  deregistration_delay = 90
  tags                 = var.tags

  health_check {
    path                = "/readyz"
    interval            = 10
    healthy_threshold   = 2
    unhealthy_threshold = 2
    matcher             = "200"
  }
}

resource "aws_lb_listener" "https" {
  load_balancer_arn = aws_lb.internal.arn
  port              = 443
  protocol          = "HTTPS"
  certificate_arn   = var.certificate_arn
  ssl_policy        = "ELBSecurityPolicy-TLS13-1-2-2021-06"
  tags              = var.tags
  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.replicas.arn
  }
}

# The balancer's admin endpoints have no authentication, and its metrics are for Prometheus:
# neither is reachable from outside.
resource "aws_lb_listener_rule" "private_paths" {
  listener_arn = aws_lb_listener.https.arn
  priority     = 10
  tags         = var.tags
  condition {
    path_pattern {
      values = ["/admin", "/admin/*", "/metrics"]
    }
  }
  action {
    type = "fixed-response"
    fixed_response {
      content_type = "text/plain"
      message_body = "not found\n"
      status_code  = "404"
    }
  }
}

# -- the replicas -------------------------------------------------------------------------------

resource "aws_security_group" "replica" {
  name_prefix = "${var.name}-replica-"
  description = "Regional balancer replicas"
  vpc_id      = var.vpc_id
  tags        = var.tags

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_vpc_security_group_ingress_rule" "replica_from_alb" {
  security_group_id            = aws_security_group.replica.id
  description                  = "Requests and health checks from the internal ALB"
  ip_protocol                  = "tcp"
  from_port                    = 8600
  to_port                      = 8600
  referenced_security_group_id = aws_security_group.alb.id
}

resource "aws_vpc_security_group_ingress_rule" "replica_metrics" {
  for_each          = toset(var.monitoring_cidrs)
  security_group_id = aws_security_group.replica.id
  description       = "Prometheus scrapes /metrics"
  ip_protocol       = "tcp"
  from_port         = 8600
  to_port           = 8600
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "replica_upstream" {
  for_each          = toset(var.upstream_cidrs)
  security_group_id = aws_security_group.replica.id
  description       = "Inference instances"
  ip_protocol       = "tcp"
  from_port         = 0
  to_port           = 65535
  cidr_ipv4         = each.value
}

resource "aws_vpc_security_group_egress_rule" "replica_https" {
  security_group_id = aws_security_group.replica.id
  description       = "AWS APIs, package index"
  ip_protocol       = "tcp"
  from_port         = 443
  to_port           = 443
  cidr_ipv4         = "0.0.0.0/0"
}

resource "aws_vpc_security_group_egress_rule" "replica_push" {
  security_group_id = aws_security_group.replica.id
  description       = "Signed capacity reports to the GTM fronts; operating system package mirrors"
  ip_protocol       = "tcp"
  from_port         = 80
  to_port           = 80
  cidr_ipv4         = "0.0.0.0/0"
}

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "replica" {
  statement {
    sid       = "ReadTheRegionsReportKey"
    actions   = ["secretsmanager:GetSecretValue"]
    resources = [local.report_key_here]
  }
  statement {
    sid       = "DecryptWithTheRegionKey"
    actions   = ["kms:Decrypt"]
    resources = [var.kms_key_arn]
  }
}

resource "aws_iam_role" "replica" {
  name_prefix        = "${var.name}-"
  assume_role_policy = data.aws_iam_policy_document.assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy" "replica" {
  name   = "regional-lb"
  role   = aws_iam_role.replica.id
  policy = data.aws_iam_policy_document.replica.json
}

resource "aws_iam_role_policy_attachment" "ssm" {
  role       = aws_iam_role.replica.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonSSMManagedInstanceCore"
}

resource "aws_iam_instance_profile" "replica" {
  name_prefix = "${var.name}-"
  role        = aws_iam_role.replica.name
  tags        = var.tags
}

resource "aws_launch_template" "replica" {
  name_prefix            = "${var.name}-"
  image_id               = local.ami
  instance_type          = var.instance_type
  user_data              = module.config.user_data_base64
  vpc_security_group_ids = [aws_security_group.replica.id]
  ebs_optimized          = true
  update_default_version = true
  tags                   = var.tags

  iam_instance_profile {
    arn = aws_iam_instance_profile.replica.arn
  }

  metadata_options {
    http_tokens                 = "required"
    http_put_response_hop_limit = 1
    http_endpoint               = "enabled"
  }

  monitoring {
    enabled = true
  }

  block_device_mappings {
    device_name = "/dev/xvda"
    ebs {
      volume_type           = "gp3"
      volume_size           = 20
      encrypted             = true
      kms_key_id            = var.kms_key_arn
      delete_on_termination = true
    }
  }

  tag_specifications {
    resource_type = "instance"
    tags          = merge(var.tags, { Name = var.name, "gtm:role" = "regional-lb", "gtm:region" = var.region_id })
  }
}

resource "aws_autoscaling_group" "replicas" {
  name_prefix               = "${var.name}-"
  min_size                  = var.replicas.min
  max_size                  = var.replicas.max
  desired_capacity          = var.replicas.desired
  vpc_zone_identifier       = var.private_subnet_ids
  target_group_arns         = [aws_lb_target_group.replicas.arn]
  health_check_type         = "ELB"
  health_check_grace_period = 300

  launch_template {
    id      = aws_launch_template.replica.id
    version = aws_launch_template.replica.latest_version
  }

  # A replaced replica drains first (SIGTERM: streams in flight finish, TimeoutStopSec 90 s).
  instance_refresh {
    strategy = "Rolling"
    preferences {
      min_healthy_percentage = 50
    }
  }

  dynamic "tag" {
    for_each = merge(var.tags, { "gtm:role" = "regional-lb", "gtm:region" = var.region_id })
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
}
