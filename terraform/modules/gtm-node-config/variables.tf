variable "node_name" {
  type        = string
  description = "The node's stable name: its vote in the health membership (GTM_OBSERVER_ID) and the prefix of its audit node id (NAME-INSTANCE_ID)."
  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{0,40}$", var.node_name))
    error_message = "node_name: 1-41 lowercase letters, digits and hyphens, starting with a letter."
  }
}

variable "aws_region" {
  type        = string
  description = "AWS region the node runs in (its secrets are read from the replicas there)."
  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", var.aws_region))
    error_message = "aws_region: an AWS region name such as eu-west-1."
  }
}

variable "admin" {
  type        = bool
  description = "Serve the admin API (GTM_ADMIN_LISTEN) and hold the document signing key."
  default     = false
}

variable "health_members" {
  type        = list(string)
  description = "Every GTM node's name in the fleet (GTM_HEALTH_MEMBERS): a region's state needs a majority of them, whoever is alive, so a partitioned minority cannot move traffic on its own."
  validation {
    condition     = length(var.health_members) == length(distinct(var.health_members))
    error_message = "health_members: names must be distinct."
  }
}

variable "ops_allow" {
  type        = list(string)
  description = "Networks allowed to push capacity reports and read /metrics on the HTTP front (GTM_OPS_ALLOW): the balancers' NAT addresses and the VPC ranges."
  validation {
    condition     = alltrue([for c in var.ops_allow : can(cidrhost(c, 0)) && c != "0.0.0.0/0"])
    error_message = "ops_allow: CIDR ranges, never 0.0.0.0/0."
  }
}

variable "settings" {
  type        = map(string)
  description = "Further GTM_* settings for /etc/gtm/gtm.env (see README \"Settings\"); never a secret (GTM_DATABASE_URL, GTM_REPORT_SECRET and GTM_ADMIN_TOKEN are refused)."
  default     = {}
  validation {
    condition = alltrue([
      for k, v in var.settings :
      can(regex("^GTM_[A-Z0-9_]+$", k)) && !contains(["GTM_DATABASE_URL", "GTM_REPORT_SECRET", "GTM_ADMIN_TOKEN"], k) && !can(regex("['\\n]", v))
    ])
    error_message = "settings: GTM_* names, no secrets, values without quotes or newlines."
  }
}

variable "topology_yaml" {
  type        = string
  description = "The topology document (gtm-topology's topology_yaml), written to /etc/gtm/topology.yaml."
}

variable "policies" {
  type        = map(string)
  description = "Residency policy documents, file name => YAML, written to /etc/gtm/policies/."
  validation {
    condition     = length(var.policies) > 0 && alltrue([for f, _ in var.policies : can(regex("^[A-Za-z0-9._-]+\\.ya?ml$", f))])
    error_message = "policies: one or more, named like eu-personal.yaml."
  }
}

variable "secrets" {
  type = object({
    report_secret         = string
    document_signing_key  = string
    document_public_key   = string
    admin_bootstrap_token = string
    dns_cookie_secret     = string
    db_login              = string
  })
  description = "Secret ids (names) the node reads: the fleet's (gtm-fleet's secret_names) and its own database login (gtm-database's login_secret_names[login])."
}

variable "database" {
  type = object({
    host = string
    port = number
    name = string
  })
  description = "The shared PostgreSQL (gtm-database's address, port and db_name); connections use TLS with the host name verified."
}

variable "bootstrap" {
  type = object({
    master_secret = string
    logins = map(object({
      role   = string
      secret = string
    }))
    report_keys = map(string)
  })
  description = "Set on exactly one admin node of the fleet: the RDS owner's secret, every login to create (login => role and secret id) and every balancer region's report-key secret (region => secret id). Null elsewhere."
  default     = null
}

variable "checkpoint_bucket" {
  type = object({
    name   = string
    region = string
  })
  description = "The Object Lock bucket the checkpoints are synced to (gtm-fleet's checkpoint_bucket) and its region."
}

variable "geoip_s3_uri" {
  type        = string
  description = "s3://bucket/key of a GeoIP2/GeoLite2 City database to fetch daily (GTM_GEOIP_PATH); null: the bundled 2018 GeoLite2 (package spec with the geolite extra)."
  default     = null
  validation {
    condition     = var.geoip_s3_uri == null || can(regex("^s3://[a-z0-9.-]+/.+", var.geoip_s3_uri))
    error_message = "geoip_s3_uri: s3://bucket/key."
  }
}

variable "package" {
  type = object({
    spec      = string
    index_url = optional(string)
  })
  description = "What pip installs into /opt/gtm (e.g. gtm==0.1.0, or gtm[geolite]==0.1.0) and from which index (the project's wheel published to your private index)."
  validation {
    condition     = length(var.package.spec) > 0 && (var.package.index_url == null || can(regex("^https://[^@]+$", var.package.index_url)))
    error_message = "package: a non-empty spec; index_url over https and without credentials in it."
  }
  validation {
    condition     = var.geoip_s3_uri != null || strcontains(var.package.spec, "geolite")
    error_message = "package: without geoip_s3_uri the node needs the bundled database (the geolite extra: gtm[geolite]==...)."
  }
}
