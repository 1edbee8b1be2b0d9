"""`dflash-serve`: the command line above engine/, deployments/, cluster/ and loadtest/ (dflash_serve/cli.py)."""
