"""What a run is: the schema both jobs share, each job's configuration, and a run's directory read back.
Imports core and machine."""
