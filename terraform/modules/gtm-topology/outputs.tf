output "topology_yaml" {
  description = "The topology document (YAML): the nodes' start-up file (GTM_CONFIG) and the first proposal to activate through the admin API."
  value       = "# Rendered by terraform/modules/gtm-topology: zone, regions and services.\n${yamlencode(local.topology)}"
}

output "delegation" {
  description = "What the parent zone must hold: the NS record set of the apex (same names as the NS GTM serves) and the glue (A/AAAA) of every name server inside the zone."
  value = {
    zone        = var.zone.apex
    ttl         = var.zone.ttl
    nameservers = [for ns in var.nameservers : ns.name]
    glue        = local.glue
  }
}

output "nameserver_names" {
  description = "Names of the zone's name servers (the NS set), the first being the SOA's primary name."
  value       = [for ns in var.nameservers : ns.name]
}
