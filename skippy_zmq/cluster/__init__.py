"""A cluster of hosts: measuring them (measure.py), workers that join a driver and the weights they fetch."""
