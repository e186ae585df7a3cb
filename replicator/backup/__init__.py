"""The bucket tier: storage backends, the backup commit protocol, scheduling and each host's share."""
