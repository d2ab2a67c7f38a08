# Three regions end to end: eu-west-1 (the database, the admin API, the bootstrap node),
# us-east-1 and ap-south-1. Every region runs GTM nodes behind its own DNS/HTTP load balancer
# and a regional balancer; every GTM node shares the one PostgreSQL (through VPC peering) and
# votes in one health membership; the parent zone delegates to one name server per region.

locals {
  tags = { "gtm:fleet" = var.name, "managed-by" = "terraform" }

  regions = {
    "eu-west"  = { aws = "eu-west-1", cidr = "10.10.0.0/16", name = "EU West (Ireland)", lat = 53.35, lon = -6.26, jurisdiction = "EU" }
    "us-east"  = { aws = "us-east-1", cidr = "10.20.0.0/16", name = "US East (Virginia)", lat = 39.04, lon = -77.49, jurisdiction = "US" }
    "ap-south" = { aws = "ap-south-1", cidr = "10.30.0.0/16", name = "Asia Pacific South (Mumbai)", lat = 19.08, lon = 72.88, jurisdiction = "IN" }
  }

  # Stable node names: each is one vote in the membership, whatever instance runs it.
  nodes = { for r, _ in local.regions : r => [for i in range(var.nodes_per_region) : "gtm-${r}-${i + 1}"] }
  # The membership lists every node of every region: no node or region can form a fleet alone.
  health_members = flatten([for r in sort(keys(local.nodes)) : local.nodes[r]])

  login_of = { for n in local.health_members : n => replace(n, "-", "_") }
  logins = merge(
    { for n in local.health_members : local.login_of[n] => { role = startswith(n, "gtm-eu-west-") ? "gtm_admin" : "gtm_node" } },
    { grafana_reader = { role = "gtm_reader" } },
  )

  policies = { for f in fileset("${path.module}/policies", "*.yaml") : f => file("${path.module}/policies/${f}") }

  nat_ips = concat(module.base_eu.nat_public_ips, module.base_us.nat_public_ips, module.base_ap.nat_public_ips)
  vpcs    = [module.base_eu.vpc_cidr, module.base_us.vpc_cidr, module.base_ap.vpc_cidr]
  # Capacity reports come from the balancers' NAT addresses; /metrics from inside the VPCs.
  ops_allow = concat([for ip in local.nat_ips : "${ip}/32"], local.vpcs)

  balancers = {
    "eu-west"  = module.balancer_eu
    "us-east"  = module.balancer_us
    "ap-south" = module.balancer_ap
  }
  gtm_urls = [module.gtm_eu.front_url, module.gtm_us.front_url, module.gtm_ap.front_url]

  shared = {
    database = {
      host = module.database.address
      port = module.database.port
      name = module.database.db_name
      cidr = module.base_eu.vpc_cidr
    }
    fleet_secrets = { names = module.fleet.secret_names, arns = module.fleet.secret_arns }
    login_secrets = { names = module.database.login_secret_names, arns = module.database.login_secret_arns }
    checkpoint_bucket = {
      name        = module.fleet.checkpoint_bucket
      arn         = module.fleet.checkpoint_bucket_arn
      region      = "eu-west-1"
      kms_key_arn = module.base_eu.kms_key_arn
    }
  }
}

# -- each region's base ------------------------------------------------------------------------

module "base_eu" {
  source             = "../../modules/region-base"
  providers          = { aws = aws.eu }
  name               = "${var.name}-euw1"
  cidr_block         = local.regions["eu-west"].cidr
  availability_zones = ["eu-west-1a", "eu-west-1b"]
}

module "base_us" {
  source             = "../../modules/region-base"
  providers          = { aws = aws.us }
  name               = "${var.name}-use1"
  cidr_block         = local.regions["us-east"].cidr
  availability_zones = ["us-east-1a", "us-east-1b"]
}

module "base_ap" {
  source             = "../../modules/region-base"
  providers          = { aws = aws.ap }
  name               = "${var.name}-aps1"
  cidr_block         = local.regions["ap-south"].cidr
  availability_zones = ["ap-south-1a", "ap-south-1b"]
}

module "peering_us" {
  source    = "../../modules/vpc-peering"
  providers = { aws = aws.us, aws.accepter = aws.eu }
  name      = "${var.name}-use1-euw1"
  requester = { vpc_id = module.base_us.vpc_id, cidr = module.base_us.vpc_cidr, route_table_ids = module.base_us.private_route_table_ids }
  accepter  = { vpc_id = module.base_eu.vpc_id, cidr = module.base_eu.vpc_cidr, region = "eu-west-1", route_table_ids = module.base_eu.private_route_table_ids }
}

module "peering_ap" {
  source    = "../../modules/vpc-peering"
  providers = { aws = aws.ap, aws.accepter = aws.eu }
  name      = "${var.name}-aps1-euw1"
  requester = { vpc_id = module.base_ap.vpc_id, cidr = module.base_ap.vpc_cidr, route_table_ids = module.base_ap.private_route_table_ids }
  accepter  = { vpc_id = module.base_eu.vpc_id, cidr = module.base_eu.vpc_cidr, region = "eu-west-1", route_table_ids = module.base_eu.private_route_table_ids }
}

# -- fleet-wide: secrets, checkpoints, the one database -------------------------------------

module "fleet" {
  source           = "../../modules/gtm-fleet"
  providers        = { aws = aws.eu }
  name             = var.name
  kms_key_arn      = module.base_eu.kms_key_arn
  balancer_regions = sort(keys(local.regions))
  replica_kms_key_arns = {
    "us-east-1"  = module.base_us.kms_key_arn
    "ap-south-1" = module.base_ap.kms_key_arn
  }
}

module "database" {
  source              = "../../modules/gtm-database"
  providers           = { aws = aws.eu }
  name                = "${var.name}-db"
  vpc_id              = module.base_eu.vpc_id
  subnet_ids          = module.base_eu.private_subnet_ids
  client_cidrs        = local.vpcs
  kms_key_arn         = module.base_eu.kms_key_arn
  logins              = local.logins
  deletion_protection = var.deletion_protection
  replica_kms_key_arns = {
    "us-east-1"  = module.base_us.kms_key_arn
    "ap-south-1" = module.base_ap.kms_key_arn
  }
}

# -- regional balancers ------------------------------------------------------------------------

module "balancer_eu" {
  source              = "../../modules/regional-balancer"
  providers           = { aws = aws.eu }
  name                = "${var.name}-rlb-euw1"
  region_id           = "eu-west"
  hostname            = "eu-west.${var.inference_domain}"
  certificate_arn     = var.certificate_arns["eu-west"]
  route53_zone_id     = var.parent_zone.id
  vpc_id              = module.base_eu.vpc_id
  public_subnet_ids   = module.base_eu.public_subnet_ids
  private_subnet_ids  = module.base_eu.private_subnet_ids
  kms_key_arn         = module.base_eu.kms_key_arn
  config_yaml         = file("${path.module}/balancers/eu-west.yaml")
  gtm_urls            = local.gtm_urls
  report_key_secret   = { name = module.fleet.secret_names["report-key/eu-west"], arn = module.fleet.secret_arns["report-key/eu-west"] }
  upstream_cidrs      = [module.base_eu.vpc_cidr]
  monitoring_cidrs    = var.monitoring_cidrs
  package             = var.package
  deletion_protection = var.deletion_protection
}

module "balancer_us" {
  source              = "../../modules/regional-balancer"
  providers           = { aws = aws.us }
  name                = "${var.name}-rlb-use1"
  region_id           = "us-east"
  hostname            = "us-east.${var.inference_domain}"
  certificate_arn     = var.certificate_arns["us-east"]
  route53_zone_id     = var.parent_zone.id
  vpc_id              = module.base_us.vpc_id
  public_subnet_ids   = module.base_us.public_subnet_ids
  private_subnet_ids  = module.base_us.private_subnet_ids
  kms_key_arn         = module.base_us.kms_key_arn
  config_yaml         = file("${path.module}/balancers/us-east.yaml")
  gtm_urls            = local.gtm_urls
  report_key_secret   = { name = module.fleet.secret_names["report-key/us-east"], arn = module.fleet.secret_arns["report-key/us-east"] }
  upstream_cidrs      = [module.base_us.vpc_cidr]
  monitoring_cidrs    = var.monitoring_cidrs
  package             = var.package
  deletion_protection = var.deletion_protection
}

module "balancer_ap" {
  source              = "../../modules/regional-balancer"
  providers           = { aws = aws.ap }
  name                = "${var.name}-rlb-aps1"
  region_id           = "ap-south"
  hostname            = "ap-south.${var.inference_domain}"
  certificate_arn     = var.certificate_arns["ap-south"]
  route53_zone_id     = var.parent_zone.id
  vpc_id              = module.base_ap.vpc_id
  public_subnet_ids   = module.base_ap.public_subnet_ids
  private_subnet_ids  = module.base_ap.private_subnet_ids
  kms_key_arn         = module.base_ap.kms_key_arn
  config_yaml         = file("${path.module}/balancers/ap-south.yaml")
  gtm_urls            = local.gtm_urls
  report_key_secret   = { name = module.fleet.secret_names["report-key/ap-south"], arn = module.fleet.secret_arns["report-key/ap-south"] }
  upstream_cidrs      = [module.base_ap.vpc_cidr]
  monitoring_cidrs    = var.monitoring_cidrs
  package             = var.package
  deletion_protection = var.deletion_protection
}

# -- the topology and the delegation, from one list of name servers -------------------------

module "topology" {
  source = "../../modules/gtm-topology"
  zone   = var.zone
  # One name server per region: its name's glue is that region's load balancer addresses.
  nameservers = [
    { name = "ns1.${var.zone.apex}", ipv4 = module.gtm_eu.nameserver_ipv4 },
    { name = "ns2.${var.zone.apex}", ipv4 = module.gtm_us.nameserver_ipv4 },
    { name = "ns3.${var.zone.apex}", ipv4 = module.gtm_ap.nameserver_ipv4 },
  ]
  regions = [
    for id in sort(keys(local.regions)) : {
      id           = id
      name         = local.regions[id].name
      lat          = local.regions[id].lat
      lon          = local.regions[id].lon
      jurisdiction = local.regions[id].jurisdiction
      ipv4         = local.balancers[id].answer_ipv4
      base_url     = local.balancers[id].base_url
      probe_url    = local.balancers[id].probe_url
    }
  ]
  services   = var.services
  extra_yaml = file("${path.module}/routing.yaml")
}

module "delegation" {
  source           = "../../modules/dns-delegation"
  providers        = { aws = aws.eu }
  parent_zone_id   = var.parent_zone.id
  parent_zone_name = var.parent_zone.name
  delegation       = module.topology.delegation
}

# -- GTM nodes ---------------------------------------------------------------------------------

module "gtm_eu" {
  source              = "../../modules/gtm-region"
  providers           = { aws = aws.eu }
  name                = "${var.name}-euw1"
  nodes               = { for n in local.nodes["eu-west"] : n => { login = local.login_of[n] } }
  health_members      = local.health_members
  vpc_id              = module.base_eu.vpc_id
  public_subnet_ids   = module.base_eu.public_subnet_ids
  private_subnet_ids  = module.base_eu.private_subnet_ids
  kms_key_arn         = module.base_eu.kms_key_arn
  admin               = { enabled = true, allowed_cidrs = var.admin_cidrs }
  ops_allow           = local.ops_allow
  monitoring_cidrs    = var.monitoring_cidrs
  database            = local.shared.database
  fleet_secrets       = local.shared.fleet_secrets
  login_secrets       = local.shared.login_secrets
  checkpoint_bucket   = local.shared.checkpoint_bucket
  topology_yaml       = module.topology.topology_yaml
  policies            = local.policies
  geoip_s3_uri        = var.geoip_s3_uri
  package             = var.package
  certificate_arn     = lookup(var.front_certificate_arns, "eu-west", null)
  deletion_protection = var.deletion_protection
  bootstrap = {
    master_secret_arn  = module.database.master_user_secret_arn
    logins             = local.logins
    report_key_regions = sort(keys(local.regions))
  }
}

module "gtm_us" {
  source              = "../../modules/gtm-region"
  providers           = { aws = aws.us }
  name                = "${var.name}-use1"
  nodes               = { for n in local.nodes["us-east"] : n => { login = local.login_of[n] } }
  health_members      = local.health_members
  vpc_id              = module.base_us.vpc_id
  public_subnet_ids   = module.base_us.public_subnet_ids
  private_subnet_ids  = module.base_us.private_subnet_ids
  kms_key_arn         = module.base_us.kms_key_arn
  ops_allow           = local.ops_allow
  monitoring_cidrs    = var.monitoring_cidrs
  database            = local.shared.database
  fleet_secrets       = local.shared.fleet_secrets
  login_secrets       = local.shared.login_secrets
  checkpoint_bucket   = local.shared.checkpoint_bucket
  topology_yaml       = module.topology.topology_yaml
  policies            = local.policies
  geoip_s3_uri        = var.geoip_s3_uri
  package             = var.package
  certificate_arn     = lookup(var.front_certificate_arns, "us-east", null)
  deletion_protection = var.deletion_protection
}

module "gtm_ap" {
  source              = "../../modules/gtm-region"
  providers           = { aws = aws.ap }
  name                = "${var.name}-aps1"
  nodes               = { for n in local.nodes["ap-south"] : n => { login = local.login_of[n] } }
  health_members      = local.health_members
  vpc_id              = module.base_ap.vpc_id
  public_subnet_ids   = module.base_ap.public_subnet_ids
  private_subnet_ids  = module.base_ap.private_subnet_ids
  kms_key_arn         = module.base_ap.kms_key_arn
  ops_allow           = local.ops_allow
  monitoring_cidrs    = var.monitoring_cidrs
  database            = local.shared.database
  fleet_secrets       = local.shared.fleet_secrets
  login_secrets       = local.shared.login_secrets
  checkpoint_bucket   = local.shared.checkpoint_bucket
  topology_yaml       = module.topology.topology_yaml
  policies            = local.policies
  geoip_s3_uri        = var.geoip_s3_uri
  package             = var.package
  certificate_arn     = lookup(var.front_certificate_arns, "ap-south", null)
  deletion_protection = var.deletion_protection
}
