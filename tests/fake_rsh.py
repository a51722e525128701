"""A stand-in for ssh in the multi-host tests: ``fake_rsh.py HOST COMMAND`` runs COMMAND with
sh inside the network namespace that plays HOST (FAKE_RSH_HOSTS="addr=namespace,...") and
gives the ranks there that host's identity (AHCOMM_SERVER_ID), as a real host would have."""

import os
import sys

host, command = sys.argv[1], sys.argv[2]
namespaces = dict(item.split("=", 1) for item in os.environ["FAKE_RSH_HOSTS"].split(","))
os.environ["AHCOMM_SERVER_ID"] = namespaces[host]
os.execvp("ip", ["ip", "netns", "exec", namespaces[host], "sh", "-c", command])
