from gtm.cli.main import app

app(prog_name="gtm")
