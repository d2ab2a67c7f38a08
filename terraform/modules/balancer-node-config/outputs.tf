output "user_data" {
  description = "The cloud-config document (plain text; what tests check)."
  value       = local.user_data
}

output "user_data_base64" {
  description = "The same document gzipped and base64-encoded, for a launch template's user_data (EC2 allows 16 KiB; cloud-init unpacks gzip)."
  value       = base64gzip(local.user_data)
}

output "config_yaml" {
  description = "The balancer configuration written to /etc/regional-lb/config.yaml."
  value       = yamlencode(local.config)
}
