variable "name" {
  type        = string
  description = "Identifier of the database instance and prefix of its login secrets (NAME/db/LOGIN)."
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,40}$", var.name))
    error_message = "name: 2-41 characters, lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "vpc_id" {
  type        = string
  description = "VPC of the database (the fleet's primary region)."
}

variable "subnet_ids" {
  type        = list(string)
  description = "Private subnets in at least two availability zones (Multi-AZ)."
  validation {
    condition     = length(var.subnet_ids) >= 2
    error_message = "subnet_ids: at least two subnets in different availability zones."
  }
}

variable "client_cidrs" {
  type        = list(string)
  description = "Ranges PostgreSQL accepts connections from: the VPC ranges of every region with GTM nodes (peered with this VPC)."
  validation {
    condition     = length(var.client_cidrs) > 0 && alltrue([for c in var.client_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "client_cidrs: one or more private IPv4 ranges (never 0.0.0.0/0)."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "KMS key in this region: storage, Performance Insights, logs, the managed master password and the login secrets."
  validation {
    condition     = can(regex("^arn:aws[a-z-]*:kms:", var.kms_key_arn))
    error_message = "kms_key_arn: the ARN of a KMS key."
  }
}

variable "replica_kms_key_arns" {
  type        = map(string)
  description = "Other regions with GTM nodes (region name => KMS key ARN there): the login secrets are replicated to them."
  default     = {}
}

variable "engine_version" {
  type        = string
  description = "PostgreSQL major version (the parameter group family follows it)."
  default     = "16"
  validation {
    condition     = contains(["15", "16", "17"], var.engine_version)
    error_message = "engine_version: 15, 16 or 17."
  }
}

variable "instance_class" {
  type        = string
  description = "RDS instance class."
  default     = "db.m7g.large"
  validation {
    condition     = startswith(var.instance_class, "db.")
    error_message = "instance_class: an RDS class such as db.m7g.large."
  }
}

variable "allocated_storage_gb" {
  type        = number
  description = "Initial storage; it grows by itself up to max_allocated_storage_gb."
  default     = 100
  validation {
    condition     = var.allocated_storage_gb >= 20
    error_message = "allocated_storage_gb: at least 20."
  }
}

variable "max_allocated_storage_gb" {
  type        = number
  description = "Storage autoscaling ceiling (the audit log grows with traffic until retention cuts it)."
  default     = 1000
  validation {
    condition     = var.max_allocated_storage_gb >= var.allocated_storage_gb
    error_message = "max_allocated_storage_gb: at least allocated_storage_gb."
  }
}

variable "backup_retention_days" {
  type        = number
  description = "Automated backups (point-in-time recovery window)."
  default     = 14
  validation {
    condition     = var.backup_retention_days >= 7 && var.backup_retention_days <= 35
    error_message = "backup_retention_days: 7 to 35."
  }
}

variable "deletion_protection" {
  type        = bool
  description = "Refuse to delete the instance (turn off only to tear a test fleet down)."
  default     = true
}

variable "logins" {
  type = map(object({
    role = string
  }))
  description = "Database logins (name => the role of migration 0007 it is a member of: gtm_node, gtm_admin or gtm_reader). One per GTM node, one per admin node, readers for dashboards. The bootstrap node creates them and stores their passwords here; Terraform never sees one."
  validation {
    condition = alltrue([
      for login, l in var.logins :
      can(regex("^[a-z][a-z0-9_]{0,62}$", login)) && contains(["gtm_node", "gtm_admin", "gtm_reader"], l.role)
    ])
    error_message = "logins: names are lowercase PostgreSQL identifiers; role is gtm_node, gtm_admin or gtm_reader."
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
