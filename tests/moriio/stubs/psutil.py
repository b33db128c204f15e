# Stands in for psutil, which vLLM's network_utils.py (make_zmq_socket) imports to size socket
# buffers: 512 MiB SO_RCVBUF/SO_SNDBUF when the machine has over 32 GiB in total and 16 GiB
# available, else the system default. virtual_memory() here reads the same two figures from
# /proc/meminfo (MemTotal, MemAvailable) that psutil reads on Linux, so the choice is psutil's;
# either way buffer sizes change no byte on the wire. Process and NoSuchProcess exist only for
# an annotation (find_process_using_port, which the harness never calls).
from collections import namedtuple

from _pdkv_stub import placeholder

_Memory = namedtuple("_Memory", ["total", "available"])


def virtual_memory():
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = int(value.split()[0]) * 1024
    return _Memory(total=fields["MemTotal"], available=fields["MemAvailable"])


Process = placeholder("psutil.Process")


class NoSuchProcess(Exception):
    pass


def net_connections(*args, **kwargs):
    raise RuntimeError("psutil.net_connections is a pdkv stub")
