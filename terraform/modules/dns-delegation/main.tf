# The delegation of the GTM zone in its parent (Route 53): the NS record set at the child's
# apex and the glue for name servers inside the child zone. The records come from
# gtm-topology, the same list the GTM nodes serve as their own NS set and SOA.

resource "aws_route53_record" "ns" {
  zone_id = var.parent_zone_id
  name    = trimsuffix(var.delegation.zone, ".")
  type    = "NS"
  ttl     = var.delegation.ttl
  records = var.delegation.nameservers
}

resource "aws_route53_record" "glue" {
  for_each = { for g in var.delegation.glue : "${g.name} ${g.type}" => g }
  zone_id  = var.parent_zone_id
  name     = trimsuffix(each.value.name, ".")
  type     = each.value.type
  ttl      = var.delegation.ttl
  records  = each.value.records
}
