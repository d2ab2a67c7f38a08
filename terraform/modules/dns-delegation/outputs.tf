output "ns_record_fqdn" {
  description = "Name of the NS record set written in the parent zone (the delegated zone's apex)."
  value       = aws_route53_record.ns.fqdn
}

output "nameservers" {
  description = "The NS set published in the parent zone (compare with `dig NS <zone> @<a GTM node>`)."
  value       = aws_route53_record.ns.records
}

output "glue_records" {
  description = "Glue published in the parent zone, as \"name type\" => addresses."
  value       = { for k, r in aws_route53_record.glue : k => r.records }
}
