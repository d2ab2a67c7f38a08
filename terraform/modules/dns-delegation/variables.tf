variable "parent_zone_id" {
  type        = string
  description = "Route 53 hosted zone ID of the parent zone (the zone that contains the GTM zone's apex)."
  validation {
    condition     = can(regex("^Z[A-Z0-9]{4,32}$", var.parent_zone_id))
    error_message = "parent_zone_id: a Route 53 hosted zone ID (Z...)."
  }
}

variable "parent_zone_name" {
  type        = string
  description = "Name of the parent zone, absolute (example.com.): checked to contain the delegated zone."
  validation {
    condition     = can(regex("\\.$", var.parent_zone_name))
    error_message = "parent_zone_name: an absolute name ending in a dot."
  }
}

variable "delegation" {
  type = object({
    zone        = string
    ttl         = number
    nameservers = list(string)
    glue = list(object({
      name    = string
      type    = string
      records = list(string)
    }))
  })
  description = "The delegation to publish: pass gtm-topology's delegation output unchanged, so the parent's NS set and glue are the ones GTM serves."
  validation {
    condition     = length(var.delegation.nameservers) >= 2 && alltrue([for g in var.delegation.glue : contains(["A", "AAAA"], g.type) && length(g.records) > 0])
    error_message = "delegation: at least two name servers; glue records are A or AAAA with at least one address."
  }
  validation {
    condition     = endswith(var.delegation.zone, ".${var.parent_zone_name}") && var.delegation.zone != var.parent_zone_name
    error_message = "delegation.zone must be a proper subdomain of parent_zone_name."
  }
  validation {
    # Every name server inside the delegated zone needs glue (else resolvers cannot find it).
    condition = alltrue([
      for ns in var.delegation.nameservers :
      contains([for g in var.delegation.glue : g.name], ns)
      if ns == var.delegation.zone || endswith(ns, ".${var.delegation.zone}")
    ])
    error_message = "delegation: a name server inside the delegated zone has no glue record."
  }
}
