// @greendot/client: the greendot presence protocol for browsers and Node.

export * from "./types.js";
export { DecodeError, Reader, Writer } from "./postcard.js";
export {
  decodeHello,
  decodePush,
  decodeRequestFrame,
  decodeServerFrame,
  encodeHello,
  encodePush,
  encodeRequestFrame,
  encodeServerFrame,
} from "./frames.js";
export { FrameError, FrameReader, prefixFrame } from "./framing.js";
export { type Applied, View } from "./view.js";
export { Backoff, type BackoffPolicy, DEFAULT_BACKOFF, MAX_RETRY_HINT_MS, retryHint } from "./backoff.js";
export {
  ClosedError,
  ConfigError,
  ConnectError,
  GreendotError,
  LostError,
  ProtocolError,
  RejectedError,
  ServerError,
  TimeoutError,
} from "./errors.js";
export type { Binding, Carrier, CarrierHandlers, Dial } from "./carrier.js";
export {
  dialWebSocket,
  greendotCloseCode,
  WEBSOCKET_CLOSE_BASE,
  WEBSOCKET_SUBPROTOCOL,
  webSocketCloseCode,
  type WebSocketConstructor,
  type WebSocketLike,
} from "./websocket.js";
export { type CertificateHash, dialWebTransport, type WebTransportConstructor, type WebTransportLike } from "./webtransport.js";
export { Client, type ClientEvent, type ClientOptions, type ReconnectPolicy, type Source, type Subscribed, tokenExpiry } from "./client.js";
