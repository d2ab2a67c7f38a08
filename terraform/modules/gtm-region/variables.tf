variable "name" {
  type        = string
  description = "Prefix of the region's GTM resources (e.g. gtm-prod-euw1)."
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,24}$", var.name))
    error_message = "name: 2-25 lowercase letters, digits and hyphens, starting with a letter (load balancer names are short)."
  }
}

variable "nodes" {
  type = map(object({
    login = string
  }))
  description = "This region's GTM nodes: stable node name => its database login (gtm-database's logins). Names are the health membership's votes; one instance per name, spread over the private subnets."
  validation {
    condition     = length(var.nodes) >= 1 && alltrue([for n, _ in var.nodes : can(regex("^[a-z][a-z0-9-]{0,40}$", n))])
    error_message = "nodes: one or more, named with lowercase letters, digits and hyphens."
  }
}

variable "health_members" {
  type        = list(string)
  description = "Every GTM node's name in the whole fleet (all regions): GTM_HEALTH_MEMBERS on every node."
}

variable "vpc_id" {
  type        = string
  description = "The region's VPC (region-base)."
}

variable "public_subnet_ids" {
  type        = list(string)
  description = "Public subnets for the DNS/HTTP load balancer, one Elastic IP each."
  validation {
    condition     = length(var.public_subnet_ids) >= 2
    error_message = "public_subnet_ids: at least two (two availability zones)."
  }
}

variable "private_subnet_ids" {
  type        = list(string)
  description = "Private subnets the nodes run in."
  validation {
    condition     = length(var.private_subnet_ids) >= 1
    error_message = "private_subnet_ids: at least one."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "The region's KMS key: root volumes, and the secrets' replicas here."
}

variable "instance_type" {
  type        = string
  description = "EC2 instance type of the nodes."
  default     = "c7i.large"
}

variable "ami_id" {
  type        = string
  description = "AMI of the nodes; null: the newest Amazon Linux 2023 (read once, then kept: changing it does not replace running nodes)."
  default     = null
}

variable "admin" {
  type = object({
    enabled       = bool
    allowed_cidrs = optional(list(string), [])
  })
  description = "Serve the admin API (port 9000) on this region's nodes, to these private ranges only (operators' VPN, bastions); those nodes hold the document signing key."
  default     = { enabled = false }
  validation {
    condition     = alltrue([for c in var.admin.allowed_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "admin.allowed_cidrs: private CIDR ranges, never 0.0.0.0/0."
  }
}

variable "bootstrap" {
  type = object({
    master_secret_arn  = string
    logins             = map(object({ role = string }))
    report_key_regions = list(string)
  })
  description = "Set in exactly one region (an admin region): its first node (by name) bootstraps the fleet: the RDS owner's secret, every login to create (gtm-database's logins) and every balancer region's report key. Null elsewhere."
  default     = null
}

variable "ops_allow" {
  type        = list(string)
  description = "Ranges allowed to push capacity reports and read /metrics on the HTTP front (GTM_OPS_ALLOW): every region's NAT addresses (/32) and VPC ranges."
}

variable "monitoring_cidrs" {
  type        = list(string)
  description = "Ranges Prometheus scrapes the nodes' metrics port (9100) from."
  default     = []
  validation {
    condition     = alltrue([for c in var.monitoring_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "monitoring_cidrs: CIDR ranges, never 0.0.0.0/0."
  }
}

variable "database" {
  type = object({
    host = string
    port = number
    name = string
    cidr = string
  })
  description = "The shared PostgreSQL: host, port, database name, and the range it lives in (egress is opened to it only)."
}

variable "fleet_secrets" {
  type = object({
    names = map(string)
    arns  = map(string)
  })
  description = "gtm-fleet's secret_names and secret_arns."
}

variable "login_secrets" {
  type = object({
    names = map(string)
    arns  = map(string)
  })
  description = "gtm-database's login_secret_names and login_secret_arns."
}

variable "checkpoint_bucket" {
  type = object({
    name        = string
    arn         = string
    region      = string
    kms_key_arn = string
  })
  description = "The checkpoint bucket (gtm-fleet), its region and the KMS key that encrypts it."
}

variable "topology_yaml" {
  type        = string
  description = "gtm-topology's topology_yaml."
}

variable "policies" {
  type        = map(string)
  description = "Residency policies, file name => YAML."
}

variable "settings" {
  type        = map(string)
  description = "Further GTM_* settings for every node of the region."
  default     = {}
}

variable "geoip_s3_uri" {
  type        = string
  description = "s3://bucket/key of the GeoIP City database; null: the bundled GeoLite2."
  default     = null
}

variable "package" {
  type = object({
    spec      = string
    index_url = optional(string)
  })
  description = "What pip installs on the nodes, and from which index."
}

variable "certificate_arn" {
  type        = string
  description = "ACM certificate for a TLS listener on 443 in front of the HTTP front (its service host names); null: port 80 only."
  default     = null
}

variable "deletion_protection" {
  type        = bool
  description = "Protect the load balancer from deletion."
  default     = true
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
