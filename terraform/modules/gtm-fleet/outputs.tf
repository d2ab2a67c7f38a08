output "secret_arns" {
  description = "ARN of each fleet secret in the primary region, by name: report-secret, document-signing-key, document-public-key, admin-bootstrap-token, dns-cookie-secret, report-key/REGION. The same name reads the replica in another region."
  value       = { for k, s in aws_secretsmanager_secret.this : k => s.arn }
}

output "secret_names" {
  description = "Name (secret id) of each fleet secret, by the same keys as secret_arns: the id works in every region the secret is replicated to."
  value       = { for k, s in aws_secretsmanager_secret.this : k => s.name }
}

output "checkpoint_bucket" {
  description = "Name of the Object Lock bucket the nodes sync their audit checkpoints to (gtm audit verify --checkpoints reads a copy of it)."
  value       = aws_s3_bucket.checkpoints.bucket
}

output "checkpoint_bucket_arn" {
  description = "ARN of the checkpoint bucket."
  value       = aws_s3_bucket.checkpoints.arn
}
