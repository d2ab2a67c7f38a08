terraform {
  required_version = ">= 1.9"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.60"
    }
  }
}

provider "aws" {
  alias  = "eu"
  region = "eu-west-1"
  default_tags {
    tags = local.tags
  }
}

provider "aws" {
  alias  = "us"
  region = "us-east-1"
  default_tags {
    tags = local.tags
  }
}

provider "aws" {
  alias  = "ap"
  region = "ap-south-1"
  default_tags {
    tags = local.tags
  }
}
