variable "name" {
  type        = string
  description = "Name of the peering connection (a tag)."
}

variable "requester" {
  type = object({
    vpc_id          = string
    cidr            = string
    route_table_ids = list(string)
  })
  description = "The VPC that asks (the default provider's region): its ID, range and the route tables that get a route to the accepter."
}

variable "accepter" {
  type = object({
    vpc_id          = string
    cidr            = string
    region          = string
    route_table_ids = list(string)
  })
  description = "The VPC that accepts (the aws.accepter provider's region; the database's region): its ID, range, region and route tables."
  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", var.accepter.region))
    error_message = "accepter.region: an AWS region name such as eu-west-1."
  }
}

variable "tags" {
  type        = map(string)
  description = "Tags added to every resource."
  default     = {}
}
