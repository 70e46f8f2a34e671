DROP TABLE instance_leases;
