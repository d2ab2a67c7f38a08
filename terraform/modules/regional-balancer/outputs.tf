output "answer_ipv4" {
  description = "The region's answer addresses (the network load balancer's Elastic IPs): the region's ipv4 in the GTM topology."
  value       = aws_eip.lb[*].public_ip
}

output "base_url" {
  description = "Base URL clients are sent to (the topology's base_url)."
  value       = "https://${var.hostname}"
}

output "probe_url" {
  description = "The signed capacity report GTM probes (the topology's probe_url)."
  value       = "https://${var.hostname}/gtm/capacity"
}

output "autoscaling_group_name" {
  description = "Name of the replicas' autoscaling group."
  value       = aws_autoscaling_group.replicas.name
}

output "config_yaml" {
  description = "The configuration every replica runs with (/etc/regional-lb/config.yaml)."
  value       = module.config.config_yaml
}

output "security_group_id" {
  description = "Security group of the replicas."
  value       = aws_security_group.replica.id
}
