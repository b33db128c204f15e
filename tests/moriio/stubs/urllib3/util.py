# Stands in for urllib3.util.parse_url, which vLLM's network_utils.split_zmq_path uses to take a
# ZeroMQ path apart (scheme, host, port) before binding or connecting, only to switch IPv6 on
# for an IPv6 host and to reject a TCP path without host or port. MoRIIO's paths are
# `tcp://<host>:<port>` and `tcp://*:<port>` (from make_zmq_path), for which this gives the same
# scheme, host (brackets kept on an IPv6 literal, case kept, as urllib3 does for non-HTTP
# schemes) and integer port as urllib3.
from collections import namedtuple

Url = namedtuple("Url", ["scheme", "hostname", "port"])


def parse_url(url):
    scheme, sep, rest = url.partition("://")
    if not sep:
        return Url(None, None, None)
    netloc = rest.split("/", 1)[0]
    if netloc.startswith("["):
        end = netloc.find("]")
        host, after = netloc[: end + 1], netloc[end + 1 :]
        port = after[1:] if after.startswith(":") else ""
    else:
        host, colon, port = netloc.rpartition(":")
        if not colon:
            host, port = netloc, ""
    return Url(scheme or None, host or None, int(port) if port else None)
