variable "name" {
  type        = string
  description = "Prefix of every resource's name (e.g. gtm-prod-euw1)."
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,30}$", var.name))
    error_message = "name: 2-31 characters, lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "cidr_block" {
  type        = string
  description = "The VPC's IPv4 range; regions that peer with each other need ranges that do not overlap."
  validation {
    condition     = can(cidrhost(var.cidr_block, 0)) && tonumber(split("/", var.cidr_block)[1]) <= 20
    error_message = "cidr_block: an IPv4 CIDR of /20 or larger."
  }
}

variable "availability_zones" {
  type        = list(string)
  description = "Availability zones (names, e.g. eu-west-1a and eu-west-1b) to put subnets and NAT gateways in: named, so a zone AWS adds or retires never renumbers the subnets."
  validation {
    condition     = length(var.availability_zones) >= 2 && length(var.availability_zones) <= 3 && length(distinct(var.availability_zones)) == length(var.availability_zones)
    error_message = "availability_zones: 2 or 3 distinct zones (a load balancer and a Multi-AZ database need at least two)."
  }
}

variable "flow_log_retention_days" {
  type        = number
  description = "How long the VPC flow logs are kept (CloudWatch Logs retention)."
  default     = 365
  validation {
    condition     = contains([365, 400, 545, 731, 1096, 1827, 2192, 2557, 2922, 3288, 3653], var.flow_log_retention_days)
    error_message = "flow_log_retention_days: a CloudWatch Logs retention of at least a year (365, 400, 545, 731, ...)."
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
