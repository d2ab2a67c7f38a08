output "address" {
  description = "Host name of the database (TLS certificate name: connect with sslmode=verify-full)."
  value       = aws_db_instance.this.address
}

output "port" {
  description = "PostgreSQL port."
  value       = aws_db_instance.this.port
}

output "db_name" {
  description = "Database name."
  value       = aws_db_instance.this.db_name
}

output "master_user_secret_arn" {
  description = "ARN of the RDS-managed secret of the owner login (gtm_owner): migrations only (gtm db upgrade on the bootstrap node)."
  value       = aws_db_instance.this.master_user_secret[0].secret_arn
}

output "login_secret_names" {
  description = "Secret id of each login's credentials (login => NAME/db/LOGIN), readable in every replicated region."
  value       = { for k, s in aws_secretsmanager_secret.login : k => s.name }
}

output "login_secret_arns" {
  description = "ARN of each login's secret in the database's region (login => ARN)."
  value       = { for k, s in aws_secretsmanager_secret.login : k => s.arn }
}

output "security_group_id" {
  description = "Security group of the database."
  value       = aws_security_group.db.id
}
