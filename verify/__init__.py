"""verify: run registered operators on one device and, partitioned, on real ranks; compare; report."""
