"""Op families and their kernels. Import the public functions from `tokamax_pass`."""
