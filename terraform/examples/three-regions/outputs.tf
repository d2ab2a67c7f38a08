output "nameservers" {
  description = "The NS set of the GTM zone, as published in the parent zone and served by every node."
  value       = module.delegation.nameservers
}

output "glue" {
  description = "Glue records published in the parent zone (name and type => addresses)."
  value       = module.delegation.glue_records
}

output "topology_yaml" {
  description = "The topology the nodes start with: propose it through the admin API as the first signed version (docs/runbook.md, Deploy)."
  value       = module.topology.topology_yaml
}

output "health_members" {
  description = "GTM_HEALTH_MEMBERS of every node: all nodes of all regions."
  value       = local.health_members
}

output "admin_api" {
  description = "Admin API addresses (private; reach them from admin_cidrs): export GTM_ADMIN_URL=one of these."
  value       = [for ip in values(module.gtm_eu.node_private_ips) : "http://${ip}:9000"]
}

output "admin_bootstrap_token_secret" {
  description = "Secret id (eu-west-1) of the first admin token the bootstrap node made; read it once, make real principals, revoke it."
  value       = module.fleet.secret_names["admin-bootstrap-token"]
}

output "grafana_reader_secret" {
  description = "Secret id of the gtm_reader login for dashboards (answers by region from the audit store)."
  value       = module.database.login_secret_names["grafana_reader"]
}

output "database_address" {
  description = "Host name of the shared PostgreSQL (private)."
  value       = module.database.address
}

output "checkpoint_bucket" {
  description = "Object Lock bucket holding every node's signed checkpoints (aws s3 sync it down, then gtm audit verify --checkpoints)."
  value       = module.fleet.checkpoint_bucket
}

output "inference_endpoints" {
  description = "Base URL of each region's balancer, by GTM region id."
  value       = { for id, b in local.balancers : id => b.base_url }
}
