variable "name" {
  type        = string
  description = "The fleet's name: prefix of its secrets (NAME/...) and of the checkpoint bucket."
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name: 2-31 characters, lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key (in this provider's region, the fleet's primary region) that encrypts the secrets and the checkpoint bucket."
  validation {
    condition     = can(regex("^arn:aws[a-z-]*:kms:", var.kms_key_arn))
    error_message = "kms_key_arn: the ARN of a KMS key."
  }
}

variable "replica_kms_key_arns" {
  type        = map(string)
  description = "Other regions that run GTM nodes or balancers (region name => that region's KMS key ARN): every secret is replicated there, so a node reads its secrets in its own region."
  default     = {}
  validation {
    condition     = alltrue([for r, arn in var.replica_kms_key_arns : can(regex("^arn:aws[a-z-]*:kms:${r}:", arn))])
    error_message = "replica_kms_key_arns: each value must be the ARN of a KMS key in the region named by its key."
  }
}

variable "balancer_regions" {
  type        = list(string)
  description = "GTM region ids (as in the topology) that run regional balancers: each gets a secret for its capacity-report key (gtm report-key REGION)."
  validation {
    condition     = length(var.balancer_regions) > 0 && alltrue([for r in var.balancer_regions : can(regex("^[a-z0-9][a-z0-9-]{0,63}$", r))])
    error_message = "balancer_regions: one or more region ids (lowercase letters, digits, hyphens)."
  }
}

variable "checkpoint_retention_days" {
  type        = number
  description = "Object Lock retention of the audit checkpoints (evidence outside the database): no one, the account root included in COMPLIANCE mode, can delete a version before it ends."
  default     = 400
  validation {
    condition     = var.checkpoint_retention_days >= 1 && var.checkpoint_retention_days <= 3650
    error_message = "checkpoint_retention_days: 1 to 3650."
  }
}

variable "checkpoint_lock_mode" {
  type        = string
  description = "Object Lock mode of the checkpoint bucket: COMPLIANCE (nobody can shorten it) or GOVERNANCE (principals with s3:BypassGovernanceRetention can)."
  default     = "COMPLIANCE"
  validation {
    condition     = contains(["COMPLIANCE", "GOVERNANCE"], var.checkpoint_lock_mode)
    error_message = "checkpoint_lock_mode: COMPLIANCE or GOVERNANCE."
  }
}

variable "secret_recovery_window_days" {
  type        = number
  description = "Days a deleted secret can still be restored."
  default     = 30
  validation {
    condition     = var.secret_recovery_window_days >= 7 && var.secret_recovery_window_days <= 30
    error_message = "secret_recovery_window_days: 7 to 30."
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
