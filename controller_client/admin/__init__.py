"""The operator's `mtc` commands; the parser is in :mod:`controller_client.admin_cli`."""
