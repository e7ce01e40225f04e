//! A reader that knows the file's length, so that no length field read from the file can make
//! it allocate or skip past the end.

use std::io::Read;

use crate::FormatError;

pub(crate) struct Bounded<R> {
    inner: R,
    pos: u64,
    len: u64,
}

impl<R: Read> Bounded<R> {
    pub fn new(inner: R, len: u64) -> Self {
        Self { inner, pos: 0, len }
    }

    pub fn pos(&self) -> u64 {
        self.pos
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn remaining(&self) -> u64 {
        self.len - self.pos
    }

    /// Fails unless `n` more bytes exist, before anything is read or allocated.
    pub fn ensure(&self, n: u64, what: &str) -> Result<(), FormatError> {
        if n > self.remaining() {
            return Err(FormatError::Truncated {
                what: format!("{what} ({n} bytes)"),
                at: self.pos,
                len: self.len,
            });
        }
        Ok(())
    }

    pub fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>, FormatError> {
        self.ensure(n, what)?;
        // `n` fits in memory: it is no larger than the file.
        let mut buf = vec![0; n as usize];
        self.inner.read_exact(&mut buf)?;
        self.pos += n;
        Ok(buf)
    }

    pub fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], FormatError> {
        self.ensure(N as u64, what)?;
        let mut buf = [0; N];
        self.inner.read_exact(&mut buf)?;
        self.pos += N as u64;
        Ok(buf)
    }

    pub fn u32(&mut self, what: &str) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub fn u64(&mut self, what: &str) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
}
