# The topology document the GTM nodes start with, and the records the parent zone needs to
# delegate to them, both made from one list of name servers: the NS set in the parent, the NS
# set GTM serves at the apex and the SOA's primary name cannot drift apart, and every name
# server inside the zone gets its glue. No resources: a pure function of its inputs.

locals {
  in_zone = {
    for ns in var.nameservers :
    ns.name => ns.name == var.zone.apex || endswith(ns.name, ".${var.zone.apex}")
  }

  zone = {
    apex = var.zone.apex
    ttl  = var.zone.ttl
    soa = {
      mname   = var.nameservers[0].name
      rname   = var.zone.hostmaster
      serial  = var.zone.serial
      refresh = var.zone.refresh
      retry   = var.zone.retry
      expire  = var.zone.expire
      minimum = var.zone.minimum
    }
    # Out-of-zone name servers are served without addresses (GTM serves glue only for names
    # inside its zone).
    nameservers = [
      for ns in var.nameservers : merge(
        { name = ns.name },
        local.in_zone[ns.name] ? { ipv4 = ns.ipv4, ipv6 = ns.ipv6 } : {}
      )
    ]
  }

  regions = [
    for r in var.regions : { for k, v in r : k => v if v != null }
  ]
  services = [
    for s in var.services : { for k, v in s : k => v if v != null }
  ]

  extra = yamldecode(var.extra_yaml == "" ? "{}" : var.extra_yaml)

  topology = merge(local.extra, {
    zone     = local.zone
    regions  = local.regions
    services = local.services
  })

  glue = flatten([
    for ns in var.nameservers : concat(
      length(ns.ipv4) > 0 ? [{ name = ns.name, type = "A", records = ns.ipv4 }] : [],
      length(ns.ipv6) > 0 ? [{ name = ns.name, type = "AAAA", records = ns.ipv6 }] : [],
    ) if local.in_zone[ns.name]
  ])
}
