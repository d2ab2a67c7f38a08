output "nameserver_ipv4" {
  description = "The load balancer's Elastic IPs (one per availability zone): this region's name server addresses, i.e. the glue of its NS name."
  value       = aws_eip.lb[*].public_ip
}

output "front_url" {
  description = "Where the region's balancers push capacity reports (the HTTP front's POST /v1/capacity, port 80 of the first address; GTM_OPS_ALLOW admits only the fleet's NAT addresses)."
  value       = "http://${aws_eip.lb[0].public_ip}"
}

output "load_balancer_arn" {
  description = "ARN of the network load balancer."
  value       = aws_lb.this.arn
}

output "node_instance_ids" {
  description = "Instance ID of each node, by node name."
  value       = { for n, i in aws_instance.node : n => i.id }
}

output "node_private_ips" {
  description = "Private address of each node, by node name (admin API on 9000 where enabled, metrics on 9100)."
  value       = { for n, i in aws_instance.node : n => i.private_ip }
}

output "security_group_id" {
  description = "Security group of the nodes."
  value       = aws_security_group.node.id
}

output "environment" {
  description = "The GTM_* settings of each node (no secrets), by node name: check GTM_HEALTH_MEMBERS and GTM_OPS_ALLOW here."
  value       = { for n, c in module.config : n => c.environment }
}
