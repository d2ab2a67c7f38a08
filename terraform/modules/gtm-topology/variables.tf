variable "zone" {
  type = object({
    apex       = string
    hostmaster = string
    serial     = number
    ttl        = optional(number, 3600)
    refresh    = optional(number, 3600)
    retry      = optional(number, 600)
    expire     = optional(number, 1209600)
    minimum    = optional(number, 60)
  })
  description = "The delegated zone GTM answers for: apex (absolute, e.g. gtm.example.com.), the SOA's hostmaster mailbox as a name (hostmaster.example.com.), serial and timers; ttl is that of the SOA and NS records, here and in the parent."
  validation {
    condition     = can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+$", var.zone.apex)) && can(regex("\\.$", var.zone.hostmaster))
    error_message = "zone.apex: a lowercase absolute name ending in a dot; zone.hostmaster: an absolute name ending in a dot."
  }
  validation {
    condition     = var.zone.serial >= 1 && var.zone.serial < 4294967296 && var.zone.ttl >= 300
    error_message = "zone.serial: 1 to 2^32-1; zone.ttl: at least 300 seconds (a delegation is not a failover mechanism)."
  }
}

variable "nameservers" {
  type = list(object({
    name = string
    ipv4 = list(string)
    ipv6 = optional(list(string), [])
  }))
  description = "The zone's name servers, each a name and the addresses its GTM nodes answer on (a region's DNS load balancer): the NS set GTM serves at the apex and the NS set of the delegation in the parent are both made from this list."
  validation {
    condition     = length(var.nameservers) >= 2 && length(distinct([for ns in var.nameservers : ns.name])) == length(var.nameservers)
    error_message = "nameservers: at least two, with distinct names (RFC 1034: a zone needs at least two name servers)."
  }
  validation {
    condition = alltrue([
      for ns in var.nameservers :
      can(regex("\\.$", ns.name)) && alltrue([for a in ns.ipv4 : can(cidrhost("${a}/32", 0))])
    ])
    error_message = "nameservers: names are absolute (end in a dot); ipv4 holds IPv4 addresses."
  }
  validation {
    # A name server inside the zone cannot be found without glue in the parent.
    condition = alltrue([
      for ns in var.nameservers :
      length(ns.ipv4) + length(ns.ipv6) > 0
      if ns.name == var.zone.apex || endswith(ns.name, ".${var.zone.apex}")
    ])
    error_message = "nameservers: a name server inside the zone needs addresses (the glue in the parent zone)."
  }
}

variable "regions" {
  type = list(object({
    id           = string
    name         = string
    lat          = number
    lon          = number
    jurisdiction = string
    ipv4         = list(string)
    ipv6         = optional(list(string), [])
    base_url     = string
    probe_url    = optional(string)
    weight       = optional(number, 1)
  }))
  description = "The inference regions GTM answers with: id, name, location, jurisdiction, answer addresses (the region balancer's load balancer), base URL and probe URL (its /gtm/capacity)."
  validation {
    condition     = length(var.regions) > 0 && length(distinct([for r in var.regions : r.id])) == length(var.regions)
    error_message = "regions: one or more, with distinct ids."
  }
  validation {
    condition = alltrue([
      for r in var.regions :
      r.lat >= -90 && r.lat <= 90 && r.lon >= -180 && r.lon <= 180 && length(r.ipv4) + length(r.ipv6) > 0 && can(regex("^https?://", r.base_url))
    ])
    error_message = "regions: lat in [-90, 90], lon in [-180, 180], at least one answer address, an http(s) base_url."
  }
}

variable "services" {
  type = list(object({
    id              = string
    dns_names       = optional(list(string), [])
    http_hosts      = optional(list(string), [])
    regions         = list(string)
    residency_class = optional(string)
    ttl             = optional(number, 30)
    http = optional(object({
      mode            = optional(string, "redirect")
      redirect_status = optional(number, 307)
    }))
  }))
  description = "The services GTM routes: DNS names (inside the zone), HTTP hosts, the regions that serve each, its residency class and answer TTL."
  validation {
    condition = alltrue(flatten([
      for s in var.services : [
        for n in s.dns_names : n == var.zone.apex || endswith(n, ".${var.zone.apex}")
      ]
    ]))
    error_message = "services: every DNS name must be inside zone.apex (absolute, ending in a dot)."
  }
  validation {
    condition = alltrue(flatten([
      for s in var.services : [for r in s.regions : contains([for x in var.regions : x.id], r)]
    ]))
    error_message = "services: every region a service names must be in regions."
  }
}

variable "extra_yaml" {
  type        = string
  description = "Further top-level sections of the topology as YAML (routing, tenants, safety); empty for their defaults."
  default     = ""
  validation {
    condition = var.extra_yaml == "" || (
      can(yamldecode(var.extra_yaml)) &&
      can(keys(yamldecode(var.extra_yaml))) &&
      length(setsubtract(try(keys(yamldecode(var.extra_yaml)), ["not a mapping"]), ["routing", "tenants", "safety"])) == 0
    )
    error_message = "extra_yaml: a YAML mapping with only routing, tenants and safety."
  }
}
