variable "name" {
  type        = string
  description = "Prefix of the balancer's resources (e.g. rlb-prod-euw1)."
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,24}$", var.name))
    error_message = "name: 2-25 lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "region_id" {
  type        = string
  description = "The GTM region id this balancer serves (as in the topology)."
}

variable "hostname" {
  type        = string
  description = "Public host name of the region's inference endpoint (e.g. eu-west.inference.example.com): the region's base_url and probe_url, and the certificate's name."
  validation {
    condition     = can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+[a-z]{2,}$", var.hostname))
    error_message = "hostname: a lowercase DNS name without a trailing dot."
  }
}

variable "certificate_arn" {
  type        = string
  description = "ACM certificate (in this region) for hostname."
  validation {
    condition     = can(regex("^arn:aws[a-z-]*:acm:", var.certificate_arn))
    error_message = "certificate_arn: an ACM certificate ARN."
  }
}

variable "route53_zone_id" {
  type        = string
  description = "Hosted zone to publish hostname in (A records to the Elastic IPs); null: publish it yourself."
  default     = null
}

variable "vpc_id" {
  type        = string
  description = "The region's VPC (region-base)."
}

variable "public_subnet_ids" {
  type        = list(string)
  description = "Public subnets for the network load balancer (one Elastic IP each)."
  validation {
    condition     = length(var.public_subnet_ids) >= 2
    error_message = "public_subnet_ids: at least two."
  }
}

variable "private_subnet_ids" {
  type        = list(string)
  description = "Private subnets for the internal application load balancer and the balancer instances."
  validation {
    condition     = length(var.private_subnet_ids) >= 2
    error_message = "private_subnet_ids: at least two."
  }
}

variable "kms_key_arn" {
  type        = string
  description = "The region's KMS key (volumes; the report key's replica here)."
}

variable "instance_type" {
  type        = string
  description = "EC2 instance type of the balancer replicas."
  default     = "c7i.large"
}

variable "ami_id" {
  type        = string
  description = "AMI of the replicas; null: the newest Amazon Linux 2023."
  default     = null
}

variable "replicas" {
  type = object({
    min     = number
    max     = number
    desired = number
  })
  description = "Size of the balancer's autoscaling group (replicas reconcile load from the model servers' own metrics)."
  default     = { min = 2, max = 4, desired = 2 }
  validation {
    condition     = var.replicas.min >= 1 && var.replicas.min <= var.replicas.desired && var.replicas.desired <= var.replicas.max
    error_message = "replicas: 1 <= min <= desired <= max."
  }
}

variable "config_yaml" {
  type        = string
  description = "The balancer configuration without region, listen and gtm_urls (see balancer-node-config)."
}

variable "gtm_urls" {
  type        = list(string)
  description = "GTM fronts to push capacity reports to."
}

variable "report_key_secret" {
  type = object({
    name = string
    arn  = string
  })
  description = "This region's report key secret (gtm-fleet's secret_names / secret_arns of report-key/REGION)."
}

variable "upstream_cidrs" {
  type        = list(string)
  description = "Ranges of the inference instances the balancer forwards to (any TCP port)."
  validation {
    condition     = length(var.upstream_cidrs) > 0 && alltrue([for c in var.upstream_cidrs : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "upstream_cidrs: one or more CIDR ranges, never 0.0.0.0/0."
  }
}

variable "monitoring_cidrs" {
  type        = list(string)
  description = "Ranges Prometheus scrapes the replicas' /metrics (port 8600) from."
  default     = []
}

variable "stream_idle_timeout_s" {
  type        = number
  description = "Idle timeout of the application load balancer: longer than the slowest gap between two streamed tokens."
  default     = 600
  validation {
    condition     = var.stream_idle_timeout_s >= 60 && var.stream_idle_timeout_s <= 4000
    error_message = "stream_idle_timeout_s: 60 to 4000."
  }
}

variable "package" {
  type = object({
    spec      = string
    index_url = optional(string)
  })
  description = "What pip installs on the replicas, and from which index."
}

variable "deletion_protection" {
  type        = bool
  description = "Protect the load balancers from deletion."
  default     = true
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
