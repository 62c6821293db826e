"""Process groups, the FSDP2/HSDP plan, backend settings and the memory and traffic estimates."""
