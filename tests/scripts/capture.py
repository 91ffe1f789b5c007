"""Captures every frame on one link (AF_PACKET, run inside the link's namespace) until a stop file exists.

Usage: capture.py LINK OUT STOP — writes the frames' bytes, concatenated, to OUT
(tests/test_isolation.py captures an owner's link, its port on the hub's bridge, and looks for
plaintext gRPC in them). The bridge device itself sees only frames addressed to the bridge.
"""
import os
import socket
import sys

link, out, stop = sys.argv[1:4]
ETH_P_ALL = 0x0003
sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(ETH_P_ALL))
sock.bind((link, 0))
sock.settimeout(0.2)
with open(out, "wb") as f:
    print("capturing", flush=True)
    while not os.path.exists(stop):
        try:
            f.write(sock.recv(65535))
        except socket.timeout:
            pass
