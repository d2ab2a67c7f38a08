# The cloud-init user data of one regional balancer instance: the package, regional-lb.service
# (the same as deploy/systemd) with an AWS drop-in, the configuration, and the script that
# fetches the region's report key. No resources: rendered and checked in tests/deploy.

locals {
  config = merge(yamldecode(var.config_yaml), {
    region   = var.region_id
    listen   = "0.0.0.0:8600"
    gtm_urls = var.gtm_urls
  })

  file = { for f in [
    "regional-lb.service", "regional-lb-aws.conf", "regional-lb-secrets.service", "regional-lb-fetch-secrets",
  ] : f => file("${path.module}/files/${f}") }

  aws_env = "region='${var.aws_region}'\nsecret_report_key='${var.report_key_secret}'\n"

  pip_index = var.package.index_url == null ? [] : ["--index-url", var.package.index_url]

  cloud_config = {
    package_update = true
    packages       = ["python3.11", "python3.11-pip", "awscli-2"]
    groups         = ["regional-lb"]
    users = [
      "default",
      {
        name           = "regional-lb"
        system         = true
        primary_group  = "regional-lb"
        no_create_home = true
        shell          = "/sbin/nologin"
      },
    ]
    write_files = [
      { path = "/etc/systemd/system/regional-lb.service", permissions = "0644", content = local.file["regional-lb.service"] },
      { path = "/etc/systemd/system/regional-lb.service.d/aws.conf", permissions = "0644", content = local.file["regional-lb-aws.conf"] },
      { path = "/etc/systemd/system/regional-lb-secrets.service", permissions = "0644", content = local.file["regional-lb-secrets.service"] },
      { path = "/usr/local/libexec/regional-lb/regional-lb-fetch-secrets", permissions = "0755", content = local.file["regional-lb-fetch-secrets"] },
      { path = "/etc/regional-lb/aws.env", permissions = "0644", content = local.aws_env },
      { path = "/etc/regional-lb/config.yaml", permissions = "0644", content = yamlencode(local.config) },
    ]
    runcmd = [
      ["python3.11", "-m", "venv", "/opt/gtm"],
      ["/opt/gtm/bin/pip", "install", "--quiet", "--upgrade", "pip"],
      concat(["/opt/gtm/bin/pip", "install", "--quiet"], local.pip_index, [var.package.spec]),
      ["/opt/gtm/bin/regional-lb", "check", "--config", "/etc/regional-lb/config.yaml"],
      ["systemctl", "daemon-reload"],
      ["systemctl", "enable", "--now", "regional-lb.service"],
    ]
  }

  user_data = "#cloud-config\n${yamlencode(local.cloud_config)}"
}
