# The cloud-init user data of one GTM node: the package, the systemd units (the same
# gtm.service as deploy/systemd, plus an AWS drop-in), the settings, topology and policies, and
# the scripts that fetch secrets, sync checkpoints and (on one node) bootstrap the fleet.
# No resources: a pure function of its inputs, rendered and checked in tests/deploy.

locals {
  listen = merge(
    {
      GTM_DNS_LISTEN     = jsonencode(["0.0.0.0:5353"])
      GTM_HTTP_LISTEN    = "0.0.0.0:8080"
      GTM_METRICS_LISTEN = "0.0.0.0:9100"
    },
    var.admin ? { GTM_ADMIN_LISTEN = "0.0.0.0:9000" } : {},
  )

  env = merge(
    {
      GTM_CONFIG           = "/etc/gtm/topology.yaml"
      GTM_POLICIES         = jsonencode(["/etc/gtm/policies"])
      GTM_OBSERVER_ID      = var.node_name
      GTM_HEALTH_MEMBERS   = jsonencode(var.health_members)
      GTM_OPS_ALLOW        = jsonencode(var.ops_allow)
      GTM_MIGRATE_ON_START = "false"
      GTM_LOG_FORMAT       = "json"
    },
    var.geoip_s3_uri == null ? {} : { GTM_GEOIP_PATH = "/var/lib/gtm-geoip/City.mmdb" },
    var.admin ? { GTM_DOCUMENT_SIGNING_KEY = "/run/gtm/keys/document-signing.key" } : {},
    var.settings,
    local.listen,
  )

  # systemd EnvironmentFile syntax: single-quoted values (no value holds a quote).
  gtm_env = join("", [for k in sort(keys(local.env)) : "${k}='${local.env[k]}'\n"])

  # Parameters of the scripts (lowercase: they are not GTM settings).
  aws_env = join("", [for k, v in {
    region                      = var.aws_region
    node_name                   = var.node_name
    admin                       = tostring(var.admin)
    secret_report               = var.secrets.report_secret
    secret_document_signing_key = var.secrets.document_signing_key
    secret_document_public_key  = var.secrets.document_public_key
    secret_admin_token          = var.secrets.admin_bootstrap_token
    secret_dns_cookie           = var.secrets.dns_cookie_secret
    secret_db_login             = var.secrets.db_login
    master_secret               = var.bootstrap == null ? "" : var.bootstrap.master_secret
    db_host                     = var.database.host
    db_port                     = tostring(var.database.port)
    db_name                     = var.database.name
    checkpoint_bucket           = var.checkpoint_bucket.name
    checkpoint_region           = var.checkpoint_bucket.region
    geoip_s3_uri                = var.geoip_s3_uri == null ? "" : var.geoip_s3_uri
  } : "${k}='${v}'\n"])

  file = { for f in [
    "gtm.service", "gtm-aws.conf", "gtm-secrets.service", "gtm-checkpoint-sync.service",
    "gtm-checkpoint-sync.timer", "gtm-geoip-update.service", "gtm-geoip-update.timer",
    "gtm-fetch-secrets", "gtm-bootstrap", "gtm-sync-checkpoints", "gtm-geoip-update",
  ] : f => file("${path.module}/files/${f}") }

  units = [
    { path = "/etc/systemd/system/gtm.service", content = local.file["gtm.service"] },
    { path = "/etc/systemd/system/gtm.service.d/aws.conf", content = local.file["gtm-aws.conf"] },
    { path = "/etc/systemd/system/gtm-secrets.service", content = local.file["gtm-secrets.service"] },
    { path = "/etc/systemd/system/gtm-checkpoint-sync.service", content = local.file["gtm-checkpoint-sync.service"] },
    { path = "/etc/systemd/system/gtm-checkpoint-sync.timer", content = local.file["gtm-checkpoint-sync.timer"] },
    { path = "/etc/systemd/system/gtm-geoip-update.service", content = local.file["gtm-geoip-update.service"] },
    { path = "/etc/systemd/system/gtm-geoip-update.timer", content = local.file["gtm-geoip-update.timer"] },
  ]
  scripts = [
    for f in ["gtm-fetch-secrets", "gtm-bootstrap", "gtm-sync-checkpoints", "gtm-geoip-update"] :
    { path = "/usr/local/libexec/gtm/${f}", permissions = "0755", content = local.file[f] }
  ]

  bootstrap_files = var.bootstrap == null ? [] : [
    {
      path        = "/etc/gtm/bootstrap/logins"
      permissions = "0600"
      content     = join("", [for login, l in var.bootstrap.logins : "${login} ${l.role} ${l.secret}\n"])
    },
    {
      path        = "/etc/gtm/bootstrap/report-keys"
      permissions = "0600"
      content     = join("", [for r, id in var.bootstrap.report_keys : "${r} ${id}\n"])
    },
  ]

  write_files = concat(
    [for u in local.units : merge(u, { permissions = "0644" })],
    local.scripts,
    [
      { path = "/etc/gtm/gtm.env", permissions = "0644", content = local.gtm_env },
      { path = "/etc/gtm/aws.env", permissions = "0644", content = local.aws_env },
      { path = "/etc/gtm/topology.yaml", permissions = "0644", content = var.topology_yaml },
    ],
    [for f, content in var.policies : { path = "/etc/gtm/policies/${f}", permissions = "0644", content = content }],
    local.bootstrap_files,
  )

  pip_index = var.package.index_url == null ? [] : ["--index-url", var.package.index_url]

  runcmd = concat(
    [
      ["python3.11", "-m", "venv", "/opt/gtm"],
      ["/opt/gtm/bin/pip", "install", "--quiet", "--upgrade", "pip"],
      concat(["/opt/gtm/bin/pip", "install", "--quiet"], local.pip_index, [var.package.spec]),
      ["curl", "-fsSL", "-o", "/etc/gtm/rds-ca.pem", "https://truststore.pki.rds.amazonaws.com/global/global-bundle.pem"],
      ["systemctl", "daemon-reload"],
    ],
    var.geoip_s3_uri == null ? [] : [
      ["systemctl", "start", "gtm-geoip-update.service"],
      ["systemctl", "enable", "gtm-geoip-update.timer"],
    ],
    var.bootstrap == null ? [] : [["/usr/local/libexec/gtm/gtm-bootstrap"]],
    [
      ["systemctl", "enable", "--now", "gtm-checkpoint-sync.timer"],
      ["systemctl", "enable", "--now", "gtm.service"],
    ],
  )

  cloud_config = {
    package_update = true
    packages       = ["python3.11", "python3.11-pip", "postgresql15", "jq", "awscli-2"]
    groups         = ["gtm"]
    users = [
      "default",
      {
        name           = "gtm"
        system         = true
        primary_group  = "gtm"
        homedir        = "/var/lib/gtm"
        no_create_home = true
        shell          = "/sbin/nologin"
      },
    ]
    write_files = local.write_files
    runcmd      = local.runcmd
  }

  user_data = "#cloud-config\n${yamlencode(local.cloud_config)}"
}
