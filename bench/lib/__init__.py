"""What the workloads, the programs and the checks share: processes, databases, reports."""
