"""Multi-process training: a job (`job`), the strategies applied to a rank's module over one DeviceMesh
(`strategies`), the one loop every strategy runs (`loop`), and which rig runs what (`support`)."""
