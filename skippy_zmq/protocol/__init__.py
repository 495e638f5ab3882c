"""The wire between processes: message frames (wire), sockets and their ZAP/CURVE security
(transport, security, keystore) and the driver's view stamps (fencing)."""
