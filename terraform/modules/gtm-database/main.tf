# The one PostgreSQL every GTM node shares (policies, region state, health observations, the
# audit log): one store, so nodes cannot split into fleets that disagree. Multi-AZ, encrypted,
# TLS required (rds.force_ssl), reachable only from the peered GTM VPCs. The master password is
# managed by RDS in Secrets Manager; nodes log in with least-privilege logins (migration 0007).

locals {
  family = "postgres${var.engine_version}"
}

resource "aws_db_subnet_group" "this" {
  name_prefix = "${var.name}-"
  subnet_ids  = var.subnet_ids
  tags        = var.tags
}

resource "aws_security_group" "db" {
  name_prefix = "${var.name}-db-"
  description = "PostgreSQL for GTM nodes"
  vpc_id      = var.vpc_id
  tags        = var.tags

  ingress {
    description = "PostgreSQL (TLS only) from the GTM VPCs"
    from_port   = 5432
    to_port     = 5432
    protocol    = "tcp"
    cidr_blocks = var.client_cidrs
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_db_parameter_group" "this" {
  name_prefix = "${var.name}-"
  family      = local.family
  description = "GTM: TLS only, connections logged"
  tags        = var.tags

  parameter {
    name  = "rds.force_ssl"
    value = "1"
  }
  parameter {
    name  = "ssl_min_protocol_version"
    value = "TLSv1.2"
  }
  parameter {
    name  = "password_encryption"
    value = "scram-sha-256"
  }
  parameter {
    name  = "log_connections"
    value = "1"
  }
  parameter {
    name  = "log_disconnections"
    value = "1"
  }
  parameter {
    name  = "log_min_duration_statement"
    value = "1000"
  }

  lifecycle {
    create_before_destroy = true
  }
}

data "aws_iam_policy_document" "monitoring_assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["monitoring.rds.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "monitoring" {
  name_prefix        = "${var.name}-rds-mon-"
  assume_role_policy = data.aws_iam_policy_document.monitoring_assume.json
  tags               = var.tags
}

resource "aws_iam_role_policy_attachment" "monitoring" {
  role       = aws_iam_role.monitoring.name
  policy_arn = "arn:aws:iam::aws:policy/service-role/AmazonRDSEnhancedMonitoringRole"
}

resource "aws_db_instance" "this" {
  #checkov:skip=CKV_AWS_161:GTM connects with a fixed URL per node (GTM_DATABASE_URL); IAM tokens expire every 15 minutes and GTM has no hook to refresh them. Logins are per node, least-privilege and their passwords live in KMS-encrypted secrets.
  identifier                            = var.name
  engine                                = "postgres"
  engine_version                        = var.engine_version
  instance_class                        = var.instance_class
  db_name                               = "gtm"
  username                              = "gtm_owner"
  manage_master_user_password           = true
  master_user_secret_kms_key_id         = var.kms_key_arn
  multi_az                              = true
  storage_type                          = "gp3"
  allocated_storage                     = var.allocated_storage_gb
  max_allocated_storage                 = var.max_allocated_storage_gb
  storage_encrypted                     = true
  kms_key_id                            = var.kms_key_arn
  db_subnet_group_name                  = aws_db_subnet_group.this.name
  vpc_security_group_ids                = [aws_security_group.db.id]
  parameter_group_name                  = aws_db_parameter_group.this.name
  publicly_accessible                   = false
  ca_cert_identifier                    = "rds-ca-rsa2048-g1"
  backup_retention_period               = var.backup_retention_days
  copy_tags_to_snapshot                 = true
  deletion_protection                   = var.deletion_protection
  skip_final_snapshot                   = false
  final_snapshot_identifier             = "${var.name}-final"
  auto_minor_version_upgrade            = true
  performance_insights_enabled          = true
  performance_insights_kms_key_id       = var.kms_key_arn
  performance_insights_retention_period = 7
  monitoring_interval                   = 60
  monitoring_role_arn                   = aws_iam_role.monitoring.arn
  enabled_cloudwatch_logs_exports       = ["postgresql", "upgrade"]
  tags                                  = var.tags

  lifecycle {
    ignore_changes = [final_snapshot_identifier]
  }
}

# One secret per login, created empty: the bootstrap node makes the login with a random
# password and puts {"username", "password"} here; each node may read only its own.
resource "aws_secretsmanager_secret" "login" {
  #checkov:skip=CKV2_AWS_57:A login's password is rotated by the runbook (ALTER ROLE on the bootstrap node, then a restart of that node): a rotation Lambda would need network access to the database and to restart the node.
  for_each                = var.logins
  name                    = "${var.name}/db/${each.key}"
  description             = "PostgreSQL login ${each.key} (member of ${each.value.role})"
  kms_key_id              = var.kms_key_arn
  recovery_window_in_days = 30
  tags                    = var.tags

  dynamic "replica" {
    for_each = var.replica_kms_key_arns
    content {
      region     = replica.key
      kms_key_id = replica.value
    }
  }
}
