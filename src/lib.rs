//! attnkit
