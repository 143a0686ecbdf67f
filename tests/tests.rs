//! Integration tests, one binary (linking is paid once). Each module runs the real `gridlm`
//! binary the way a user would.

mod it;
