variable "name" {
  type        = string
  description = "The fleet's name: prefix of every resource, secret and bucket."
  default     = "gtm"
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,11}$", var.name))
    error_message = "name: 2-12 lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "parent_zone" {
  type = object({
    id   = string
    name = string
  })
  description = "The Route 53 hosted zone the GTM zone is delegated from: its ID and absolute name (example.com.)."
}

variable "zone" {
  type = object({
    apex       = string
    hostmaster = string
    serial     = number
  })
  description = "The GTM zone (apex such as gtm.example.com., inside parent_zone), the SOA's hostmaster mailbox as a name, and the SOA serial (raise it when the NS set changes)."
}

variable "inference_domain" {
  type        = string
  description = "Domain of the regions' inference endpoints: region R is served at R.<inference_domain> (e.g. eu-west.inference.example.com), published in parent_zone."
  validation {
    condition     = can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+[a-z]{2,}$", var.inference_domain))
    error_message = "inference_domain: a lowercase DNS name without a trailing dot."
  }
}

variable "certificate_arns" {
  type        = map(string)
  description = "ACM certificate of each region's inference host name, by GTM region id (eu-west, us-east, ap-south), each in that region."
  validation {
    condition     = length(setsubtract(["eu-west", "us-east", "ap-south"], keys(var.certificate_arns))) == 0
    error_message = "certificate_arns: one for each of eu-west, us-east and ap-south."
  }
}

variable "front_certificate_arns" {
  type        = map(string)
  description = "Optional ACM certificates for the GTM HTTP front's service host names (TLS on 443), by GTM region id; regions without one serve port 80 only."
  default     = {}
}

variable "nodes_per_region" {
  type        = number
  description = "GTM nodes in each region. The health membership is every node of every region, so 2 per region gives 6 votes and a majority of 4: one region alone (or one region cut off) can never move another region's state."
  default     = 2
  validation {
    condition     = var.nodes_per_region >= 1 && var.nodes_per_region <= 5
    error_message = "nodes_per_region: 1 to 5."
  }
}

variable "admin_cidrs" {
  type        = list(string)
  description = "Private ranges operators reach the admin API (port 9000 of the eu-west nodes) from: a VPN or a bastion."
  default     = []
}

variable "monitoring_cidrs" {
  type        = list(string)
  description = "Ranges Prometheus scrapes from (GTM nodes on 9100, balancers on 8600)."
  default     = []
}

variable "package" {
  type = object({
    spec      = string
    index_url = optional(string)
  })
  description = "The GTM package pip installs on every instance (the project's wheel, published to your index)."
  default     = { spec = "gtm[geolite]==0.1.0" }
}

variable "geoip_s3_uri" {
  type        = string
  description = "s3://bucket/key of your GeoIP2/GeoLite2 City database (fetched daily); null: the bundled 2018 GeoLite2."
  default     = null
}

variable "services" {
  type = list(object({
    id              = string
    dns_names       = optional(list(string), [])
    http_hosts      = optional(list(string), [])
    regions         = list(string)
    residency_class = optional(string)
    ttl             = optional(number, 30)
  }))
  description = "The services GTM routes (names inside zone.apex); see README \"Documents\"."
}

variable "deletion_protection" {
  type        = bool
  description = "Protect the database, load balancers and nodes from deletion (turn off only to tear a test fleet down)."
  default     = true
}
