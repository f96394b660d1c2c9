//! Plumbing every role's data path shares: memory that is bounded by a budget and released when
//! the last slice of it is dropped ([`budget`], [`chunk`]), a reader that fills such chunks from a
//! socket and hands out zero-copy slices of whole messages ([`reader`]), vectored writes ([`io`]),
//! fixed buffers on huge pages ([`huge`]), order kept across a hand-off ([`line`]), and the few threads every role of a stage shares: the
//! I/O pollers ([`reactor`]), the acceptor ([`acceptor`]) and the sweeper ([`sweeper`]).

pub mod acceptor;
pub mod budget;
pub mod chunk;
pub mod clock;
pub mod control;
pub mod huge;
pub mod io;
pub mod line;
pub mod peer;
pub mod queued;
pub mod reactor;
pub mod reader;
pub mod role;
pub mod sender;
pub mod sweeper;

pub use budget::Budget;
pub use chunk::{Chunk, ChunkSlice};
pub use huge::HugeBuffer;
pub use reader::ChunkReader;
