# Stands in for urllib3, of which vLLM's network_utils.py imports only `urllib3.util.parse_url`
# (see util.py beside this file).
