from gtm.cli import app

app(prog_name="gtm")
