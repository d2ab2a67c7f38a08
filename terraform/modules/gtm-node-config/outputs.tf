output "user_data" {
  description = "The cloud-config document (plain text; readable, and what tests check)."
  value       = local.user_data
}

output "user_data_base64" {
  description = "The same document gzipped and base64-encoded, for aws_instance.user_data_base64 (EC2 allows 16 KiB of user data; cloud-init unpacks gzip)."
  value       = base64gzip(local.user_data)
}

output "environment" {
  description = "The GTM_* settings written to /etc/gtm/gtm.env (no secrets), as a map."
  value       = local.env
}
