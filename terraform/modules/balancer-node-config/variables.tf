variable "region_id" {
  type        = string
  description = "The GTM region id this balancer serves (as in the topology): the config's region."
  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{0,63}$", var.region_id))
    error_message = "region_id: lowercase letters, digits and hyphens."
  }
}

variable "aws_region" {
  type        = string
  description = "AWS region the balancer runs in (its report key is read from the replica there)."
  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", var.aws_region))
    error_message = "aws_region: an AWS region name such as eu-west-1."
  }
}

variable "config_yaml" {
  type        = string
  description = "The balancer's configuration (regional_lb/config.py: instances, models, tiers, tenants, health, ...) as YAML; region, listen and gtm_urls are set here and must not be in it."
  validation {
    condition     = can(yamldecode(var.config_yaml)) && length(setintersection(try(keys(yamldecode(var.config_yaml)), []), ["region", "listen", "gtm_urls"])) == 0
    error_message = "config_yaml: a YAML mapping without region, listen or gtm_urls (this module sets them)."
  }
}

variable "gtm_urls" {
  type        = list(string)
  description = "GTM fronts the balancer pushes its signed capacity reports to (gtm-region's front_url of every region)."
  validation {
    condition     = alltrue([for u in var.gtm_urls : can(regex("^https?://", u))])
    error_message = "gtm_urls: http(s) URLs."
  }
}

variable "report_key_secret" {
  type        = string
  description = "Secret id of this region's report key (gtm-fleet's secret_names[\"report-key/REGION\"])."
}

variable "package" {
  type = object({
    spec      = string
    index_url = optional(string)
  })
  description = "What pip installs into /opt/gtm, and from which index."
  validation {
    condition     = length(var.package.spec) > 0 && (var.package.index_url == null || can(regex("^https://[^@]+$", var.package.index_url)))
    error_message = "package: a non-empty spec; index_url over https and without credentials in it."
  }
}
