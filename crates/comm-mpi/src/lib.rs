//! The MPI backend of [`comm::Communicator`] (feature `mpi`): processes
//! started by `mpirun`, on one machine or many, through rsmpi on the
//! system's MPI (OpenMPI or MPICH); see `MpiComm`.
//!
//! A crate of its own, so that turning MPI on (which needs the system's MPI
//! and libclang) recompiles only this crate and the binary, not everything
//! that depends on `comm`. Without the feature it is empty.

#[cfg(feature = "mpi")]
mod backend;
#[cfg(feature = "mpi")]
pub use backend::MpiComm;
