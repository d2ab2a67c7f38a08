# Fleet-wide, in the primary region: the secrets every node and balancer needs, and the
# write-once bucket the audit checkpoints are synced to.
#
# Terraform creates the secrets empty: their values are made on the bootstrap node at its first
# boot (terraform/modules/gtm-node-config/files/gtm-bootstrap) and never pass through Terraform,
# so the state holds no secret.

locals {
  fleet_secrets = {
    "report-secret"         = "GTM_REPORT_SECRET: the fleet's capacity-report secret (only GTM nodes read it)"
    "document-signing-key"  = "Ed25519 private key that signs activated documents (admin nodes only)"
    "document-public-key"   = "Ed25519 public key every node verifies published documents with"
    "admin-bootstrap-token" = "The first admin API token (gtm token create); revoke it once real principals exist"
    "dns-cookie-secret"     = "The DNS cookie secret every GTM node shares (gtm dns cookie-secret), so each accepts the others' cookies"
  }
  report_keys = { for r in var.balancer_regions : "report-key/${r}" => "REGIONAL_LB_REPORT_SECRET of region ${r}'s balancers (gtm report-key ${r})" }
  secrets     = merge(local.fleet_secrets, local.report_keys)
}

resource "aws_secretsmanager_secret" "this" {
  #checkov:skip=CKV2_AWS_57:Rotation is an operator procedure (docs/runbook.md): these keys are derived from or verified against each other and need a coordinated restart, which a rotation Lambda cannot do.
  for_each                = local.secrets
  name                    = "${var.name}/${each.key}"
  description             = each.value
  kms_key_id              = var.kms_key_arn
  recovery_window_in_days = var.secret_recovery_window_days
  tags                    = var.tags

  dynamic "replica" {
    for_each = var.replica_kms_key_arns
    content {
      region     = replica.key
      kms_key_id = replica.value
    }
  }
}

resource "aws_s3_bucket" "checkpoints" {
  #checkov:skip=CKV_AWS_144:Object Lock already makes every version immutable for the retention period; cross-region replication of the evidence is an account-level choice left to the operator.
  #checkov:skip=CKV_AWS_18:Server access logs need a second bucket per fleet; CloudTrail data events cover writes to this bucket where the account requires it.
  #checkov:skip=CKV2_AWS_62:Nothing consumes events from the checkpoint bucket; verification reads it on a schedule (gtm audit verify).
  bucket_prefix       = "${var.name}-checkpoints-"
  object_lock_enabled = true
  tags                = var.tags
}

resource "aws_s3_bucket_versioning" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_object_lock_configuration" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  rule {
    default_retention {
      mode = var.checkpoint_lock_mode
      days = var.checkpoint_retention_days
    }
  }
  depends_on = [aws_s3_bucket_versioning.checkpoints]
}

resource "aws_s3_bucket_server_side_encryption_configuration" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = var.kms_key_arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_public_access_block" "checkpoints" {
  bucket                  = aws_s3_bucket.checkpoints.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_ownership_controls" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

# Versions stay as long as their lock; afterwards old versions go, the newest stays.
resource "aws_s3_bucket_lifecycle_configuration" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  rule {
    id     = "expire-old-versions-after-their-lock"
    status = "Enabled"
    filter {}
    noncurrent_version_expiration {
      noncurrent_days = var.checkpoint_retention_days + 1
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }
  depends_on = [aws_s3_bucket_versioning.checkpoints]
}

data "aws_iam_policy_document" "checkpoints" {
  statement {
    sid       = "TLSOnly"
    effect    = "Deny"
    actions   = ["s3:*"]
    resources = [aws_s3_bucket.checkpoints.arn, "${aws_s3_bucket.checkpoints.arn}/*"]
    principals {
      type        = "*"
      identifiers = ["*"]
    }
    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "checkpoints" {
  bucket = aws_s3_bucket.checkpoints.id
  policy = data.aws_iam_policy_document.checkpoints.json
}
